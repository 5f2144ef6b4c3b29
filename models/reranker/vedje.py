"""The trainable VEDJE stack: compressor (indexing path), joint reranker (query path) and the
training-only future-delta head, with the fingerprint that ties caches to the compressor."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from models.reranker.compressor import FrameCompressor, NormPlacement, Structure
from models.reranker.future_delta import FutureDeltaHead
from models.reranker.joint_encoder import JointReranker


@dataclass(frozen=True)
class VedjeShape:
    """Sizes that define the cache and the heads (everything configurable; paper defaults noted)."""

    d_v: int  # backbone channels (VideoPrism 768; EfficientNet-Lite0 1280)
    patches: int  # P (VideoPrism 256; EfficientNet-Lite0 7×7 = 49)
    frames: int  # T (paper 16; images: 1)
    tokens_per_frame: int = 4  # M (paper 4; compact 1)
    structure: Structure = "frames"
    horizons: tuple[int, ...] = field(default=(3,))  # H (paper {3})
    delta: bool = True  # train with the future-delta loss
    compressor_layers: int = 2
    heads: int = 8
    dropout: float = 0.1
    compressor_norm: NormPlacement = "post"  # LayerNorm placement in C_η (not in the paper; compressor.py)
    patch_positions: bool = False  # U_t = X_t W_kv + sinusoidal patch codes (not in the paper; compressor.py)


class Vedje(nn.Module):
    """Compressor + joint reranker (+ future-delta head when ``shape.delta`` and T > max H)."""

    def __init__(self, shape: VedjeShape, reranker: JointReranker) -> None:
        super().__init__()
        self.shape = shape
        self.reranker = reranker
        self.compressor = FrameCompressor(shape.d_v, reranker.d, shape.tokens_per_frame, shape.frames,
                                          shape.compressor_layers, shape.heads, shape.dropout, shape.structure,
                                          shape.compressor_norm, shape.patches if shape.patch_positions else None)
        use_delta = shape.delta and shape.frames > min(shape.horizons)
        if use_delta and shape.structure != "frames":
            raise ValueError("the future-delta loss needs per-frame tokens (structure 'frames')")
        self.delta_head = FutureDeltaHead(reranker.d, shape.d_v, shape.patches, shape.horizons,
                                          shape.compressor_layers, shape.heads, shape.dropout) if use_delta else None

    def delta_head_shape(self) -> tuple[int, int, int]:
        """(|H|, P, d_v) of one frame's Δ̂."""
        return len(self.shape.horizons), self.shape.patches, self.shape.d_v

    @property
    def cache_tokens(self) -> int:
        return self.shape.frames * self.shape.tokens_per_frame

    def compressor_fingerprint(self) -> str:
        """sha256 over the compressor's shape and weights: a cache is valid only for this value."""
        shape = asdict(self.shape)
        if shape["compressor_norm"] == "post":  # added later: at its default, caches indexed before stay valid
            del shape["compressor_norm"]
        if not shape["patch_positions"]:  # the same
            del shape["patch_positions"]
        h = hashlib.sha256(repr(sorted(shape.items())).encode())
        for name, tensor in sorted(self.compressor.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    @torch.no_grad()
    def index(self, x: torch.Tensor) -> torch.Tensor:
        """Offline indexing (Alg. 1, lines 2–5): features B×T×P×d_v → caches B×T·M×d (eval mode)."""
        was = self.compressor.training
        self.compressor.eval()
        try:
            return self.compressor(x.to(self.reranker.device, torch.float32)).float().cpu()
        finally:
            self.compressor.train(was)
