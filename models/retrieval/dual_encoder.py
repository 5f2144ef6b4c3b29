"""Dual encoders for retrieval training: image tower, text tower, projections, learnable temperature,
and the ITM head GTR+ adds over a joint representation.

``FeatureDualEncoder`` is the CPU model: its towers are the bundled real models, run once and
cached as features (EfficientNet-Lite0 pooled features and the semantic-bridge image vector on the
image side, MiniLM on the text side); what trains is the projection of each tower into the shared
space. The image projection is initialised so that the zero-shot model *is* the semantic-bridge
expert (its MiniLM-space image vector passes through unchanged, the raw CNN features enter with
zero weight), so fine-tuning starts from a real aligned text-image model, as the papers fine-tune
CLIP-like models. ``HFClipDualEncoder`` is the production model (any CLIP-like id through
transformers), with the vision tower trained and the text tower frozen by default.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class FeatureDualEncoder(nn.Module):
    """Projections over cached tower features. Image input: [bridge (d) ; cnn (c)]; text input:
    MiniLM (d). ``train_text`` makes the text projection trainable (SAFT keeps it frozen)."""

    def __init__(self, bridge_dim: int, cnn_dim: int, text_dim: int, temperature: float = 0.07,
                 train_text: bool = False) -> None:
        super().__init__()
        if bridge_dim != text_dim:
            raise ValueError("the bridge vector lives in the text space: bridge_dim must equal text_dim")
        self.img_proj = nn.Linear(bridge_dim + cnn_dim, text_dim)
        self.txt_proj = nn.Linear(text_dim, text_dim)
        with torch.no_grad():
            self.img_proj.weight.zero_()
            self.img_proj.weight[:, :bridge_dim].copy_(torch.eye(bridge_dim))
            self.img_proj.bias.zero_()
            self.txt_proj.weight.copy_(torch.eye(text_dim))
            self.txt_proj.bias.zero_()
        self.txt_proj.requires_grad_(train_text)
        self.log_scale = nn.Parameter(torch.tensor(math.log(1.0 / temperature)))
        self.itm_head = nn.Sequential(nn.Linear(3 * text_dim, text_dim), nn.GELU(), nn.Linear(text_dim, 2))

    @property
    def tau(self) -> torch.Tensor:
        """The temperature τ = 1 / exp(log_scale), clamped as CLIP does (scale ≤ 100)."""
        return 1.0 / self.log_scale.clamp(max=math.log(100.0)).exp()

    def encode_image(self, features: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.img_proj(features), dim=-1)

    def encode_text(self, features: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.txt_proj(features), dim=-1)

    def itm_logits(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        """Match / no-match logits over a joint representation [i ; t ; i⊙t] of the pair."""
        return self.itm_head(torch.cat([img, txt, img * txt], dim=-1))


class HFClipDualEncoder(nn.Module):
    """A CLIP-like model by Hugging Face id or local folder (CLIP, SigLIP, MobileCLIP ports...).
    The text tower is frozen unless ``train_text``; an ITM head is added for GTR+."""

    def __init__(self, model_id: str, train_text: bool = False, revision: str | None = None) -> None:
        super().__init__()
        from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

        self.model = AutoModel.from_pretrained(model_id, revision=revision)
        self.image_processor = AutoImageProcessor.from_pretrained(model_id, revision=revision)
        self.tokenizer = AutoTokenizer.from_pretrained(model_id, revision=revision)
        text_parts = [m for name, m in self.model.named_children() if "text" in name]
        for module in text_parts:
            module.requires_grad_(train_text)
        dim = int(self.model.config.projection_dim)
        self.itm_head = nn.Sequential(nn.Linear(3 * dim, dim), nn.GELU(), nn.Linear(dim, 2))

    @property
    def tau(self) -> torch.Tensor:
        return 1.0 / self.model.logit_scale.clamp(max=math.log(100.0)).exp()

    def pixel_values(self, images: list) -> torch.Tensor:
        """RGB uint8 arrays → the model's pixel values (its own resize and normalisation)."""
        return self.image_processor(images=images, return_tensors="pt")["pixel_values"]

    def tokens(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """Captions → token ids, truncated to what the text tower's positions allow (77 for CLIP)."""
        limit = int(getattr(self.model.config.text_config, "max_position_embeddings", 77))
        limit = min(limit, int(self.tokenizer.model_max_length or limit))
        return dict(self.tokenizer(texts, padding=True, truncation=True, max_length=limit, return_tensors="pt"))

    def encode_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.model.get_image_features(pixel_values=pixel_values)
        return F.normalize(getattr(out, "pooler_output", out), dim=-1)

    def encode_text(self, tokens: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.model.get_text_features(**tokens)
        return F.normalize(getattr(out, "pooler_output", out), dim=-1)

    def itm_logits(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        return self.itm_head(torch.cat([img, txt, img * txt], dim=-1))
