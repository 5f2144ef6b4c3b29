"""The ``vedje`` profile section of train-vedje, index-cache and rerank, beside the reranker's logic
in this package (data.py, features.py, training.py, model_store.py): the items, the frozen backbone
and stage-1 expert, the compressor and joint encoder, the schedule, the caches' precision and the
query-time scoring.

``rde.profile`` composes it into a ``Profile``; this module imports nothing above ``rde.common``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from models.specs import ModelSpec, Strict


class VedjeSpec(Strict):
    """``train-vedje`` / ``index-cache`` / ``rerank``: the cached joint reranker (VEDJE; App. A.2–A.3
    defaults unless noted). Items are video clips (T frames) or images (T = 1)."""

    source: Literal["clips", "largefine"] = Field("clips", description="The items: the bundled video-clip set, "
                                                  "or the images of a build-largefine run.")
    clips_path: str = Field("data/demo_clips", description="The clip-set folder (source clips).")
    source_flow: str = Field("build-largefine", description="The flow run whose images are the items (source "
                             "largefine).")
    test_share: float = Field(0.3, gt=0.0, lt=1.0, description="Source largefine: share of identities held out "
                              "for testing.")
    backbone: ModelSpec | None = Field(None, description="The frozen backbone g_φ whose feature maps are "
                                       "compressed; null = the bundled EfficientNet-Lite0.")
    first_stage: ModelSpec | None = Field(None, description="The stage-1 expert (its ρ scores and VTC targets); "
                                          "null = models.experts[0].")
    joint_encoder: ModelSpec = Field(ModelSpec(backend="bert", model_id="bundled:all-MiniLM-L6-v2"),
                                     description="The joint text-and-cache encoder (a bert backend; "
                                     "options.layers: its k layers).")
    tokens_per_frame: int = Field(4, ge=1, description="M: cached tokens per frame.")
    structure: Literal["frames", "mean", "attention"] = Field("frames", description="Cache layout: frames = M "
                                                              "tokens per frame in temporal order; mean and "
                                                              "attention pool across frames first (controls).")
    horizons: list[int] = Field(default_factory=lambda: [3], min_length=1, description="H: the frame offsets "
                                "the future-delta head predicts (positive).")
    delta: bool = Field(True, description="Train with the future-delta loss (needs structure frames).")
    train_compressor: bool = Field(True, description="false: keep the previous train-vedje run's compressor "
                                   "frozen and retrain only the reranker, so index-cache's caches stay valid.")
    compressor_layers: int = Field(2, ge=1, description="Decoder layers of the compressor C_η.")
    # models/reranker/compressor.py: the paper does not say where the LayerNorms sit
    compressor_norm: Literal["post", "pre"] = Field("post", description="LayerNorm placement in the compressor: "
                                                    "post = after each residual sum, pre = before each "
                                                    "sub-layer plus one on the output.")
    heads: int = Field(8, ge=1, description="Attention heads of the compressor and the future-delta head.")
    dropout: float = Field(0.1, ge=0.0, lt=1.0, description="Dropout of the compressor and the future-delta "
                           "head.")
    encoder_dropout: float | None = Field(None, ge=0.0, lt=1.0, description="Dropout of the joint encoder "
                                          "(embeddings, attention, hidden states) in training; null = the "
                                          "encoder's own (0.1 for BERT/MiniLM).")
    max_text_tokens: int = Field(64, ge=4, description="Text tokens of a query or caption the joint encoder "
                                 "reads at most.")
    epochs: int = Field(4, ge=1, description="Passes over the training queries.")
    batch_size: int = Field(64, ge=2, description="Queries per optimizer step.")
    train_candidates: int = Field(8, ge=2, description="VTM candidates per training query: the positive plus "
                                  "hard negatives.")
    negatives_from: int = Field(20, ge=2, description="VTM candidates come from the stage-1 top N (a query "
                                "whose positive is not in it gets no VTM term).")
    lr_start: float = Field(1e-6, gt=0.0, description="Learning rate at the start of the linear warmup.")
    lr_peak: float = Field(3e-4, gt=0.0, description="Learning rate after the warmup, then times epoch_decay "
                           "per epoch.")
    warmup_steps: int = Field(400, ge=0, description="Optimizer steps of the linear warmup.")
    epoch_decay: float = Field(0.9, gt=0.0, le=1.0, description="Factor on the learning rate per epoch after "
                               "the warmup.")
    weight_decay: float = Field(0.02, ge=0.0, description="AdamW weight decay.")
    precision: Literal["bf16", "fp8", "fp4"] = Field("bf16", description="Number format of the stored caches.")
    candidates: list[int] = Field(default_factory=lambda: [20, 50, 100], min_length=1, description="N_c: "
                                  "stage-1 candidate counts reranked and evaluated.")
    shard_size: int = Field(64, ge=1, description="Items per index-cache task.")
    score_batch: int = Field(256, ge=1, description="Query-item pairs per joint-encoder forward at query time.")
    # all give the same scores up to float rounding
    score_path: Literal["onnx", "fast", "reference"] = Field(
        "onnx", description="Query-time scoring: onnx = the fast graph in ONNX Runtime on the CPU (falls back to "
        "fast without it or on a GPU); fast = the same in PyTorch; reference = the encoder's full forward.")
    seed: int = Field(0, description="Seed of the test split (source largefine), the initialisation, the query "
                      "order and the hard negatives.")

    @model_validator(mode="after")
    def _consistent(self) -> VedjeSpec:
        if self.joint_encoder.backend != "bert":
            raise ValueError("vedje.joint_encoder.backend must be 'bert' (a BERT/MiniLM encoder by id or bundled)")
        if self.delta and self.structure != "frames":
            raise ValueError("vedje.delta needs vedje.structure 'frames' (per-frame cached tokens)")
        if any(h < 1 for h in self.horizons):
            raise ValueError("vedje.horizons must be positive frame offsets")
        return self
