"""The ``training`` profile section of train-saft and train-gtr, beside their logic in this package
(retrieval_training.py, training_data.py, gmm_confidence.py, pair_stream.py, distributed.py,
checkpoints.py): the student, the objective and its weights, the schedule, the GMM confidence
weighting and the streamed pairs.

``rde.profile`` composes it into a ``Profile``; this module imports nothing above ``rde.common``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from models.specs import ModelSpec, Strict


class TrainingSpec(Strict):
    """``train-saft`` / ``train-gtr``: a dual encoder trained on the captions of a ``build-largefine``
    run (DSMM-TBIR Sec. 3.3 / Table 8; GTR+ Sec. 3.2): the CPU model over cached tower features in
    memory, or a CLIP-like student from streamed pairs (``rde.training.pair_stream``)."""

    source_flow: str = Field("build-largefine", description="The flow whose largefine captions are the "
                             "training pairs.")
    model: ModelSpec | None = Field(None, description="The student: null = the CPU feature model over the "
                                    "bundled towers; a transformers-clip spec = any CLIP-like model by id or "
                                    "folder, its vision tower trained end to end.")
    max_pairs: int | None = Field(None, ge=2, description="Train on a seeded sample of this many pairs (the "
                                  "rest rejected as over_max_pairs); null = all.")
    views: int = Field(3, ge=1, description="The CPU model's cached views per image: view 0 the image, the others "
                       "random resized crops (a CLIP-like student draws a fresh crop at every step).")
    held_out_share: float = Field(0.3, gt=0.0, lt=1.0, description="Share of identities held out for the "
                                  "person-search evaluation.")
    epochs: int = Field(5, ge=1, description="Passes over the training pairs.")
    batch_size: int = Field(64, ge=2, description="Pairs per optimizer step.")
    lr_start: float = Field(5e-7, gt=0.0, description="Learning rate at the start of the linear warmup (SAFT: "
                            "5e-7).")
    lr_peak: float = Field(5e-6, gt=0.0, description="Learning rate after the warmup, then cosine-decayed to 0 "
                           "(SAFT: 5e-6).")
    warmup_frac: float = Field(0.1, ge=0.0, le=1.0, description="Share of the steps spent in the linear warmup.")
    weight_decay: float = Field(0.05, ge=0.0, description="AdamW weight decay.")
    tau_teacher: float = Field(0.05, gt=0.0, description="Temperature of the teacher's similarity distributions "
                               "(SAFT's τ_o).")
    alpha: float = Field(1.0, description="Weight of the SASS loss (and of CUSA's) in the SAFT objective.")
    beta: float = Field(0.75, description="Weight of the ISD loss in the SAFT objective.")
    saft_objective: Literal["itc", "itc+sass", "saft", "cusa", "hnm", "itc+iss"] = Field(
        "saft", description="train-saft's loss: saft = ITC + SASS + ISD; the others are its ablations and "
        "baselines (hnm: ITC with hard-negative mining).")
    train_text: bool = Field(False, description="Also train the text tower (SAFT keeps it frozen).")
    gtr_weighting: Literal["none", "fix", "ada"] = Field("ada", description="train-gtr's pair weights: none, "
                                                         "fix (w = q_txt) or ada (GMM confidence^β).")
    gamma: float = Field(0.2, ge=0.0, le=1.0, description="γ of ŝ = γ·s + (1 − γ)·q_txt, the score the GMM is "
                         "fitted on (GTR+ Eq. 7).")
    confidence_beta: float = Field(0.8, ge=0.0, description="β: a pair's weight is its GMM confidence to this "
                                   "power (GTR+ Eq. 10).")
    gmm_components: int = Field(2, ge=2, description="Components of the 1-D Gaussian mixture fitted after every "
                                "epoch.")
    gmm_min_fit_pairs: int = Field(10, ge=2, description="Pairs with and pairs without q_txt each need this many "
                                   "for a fit of their own; fewer keep weight 1.")
    seed: int = Field(0, description="Seed of the split, the pair sample, the crops and the initialisation.")
    processes: int = Field(1, ge=1, description="Training processes on this machine: above 1, data-parallel "
                           "(torch.distributed: gloo on the CPU, nccl with one GPU a rank when the student is on "
                           "a GPU): each step's batch is shared out, and its loss taken over the whole gathered "
                           "batch.")
    stream_above: int | None = Field(100_000, ge=0, description="The CPU model's cached features are held in "
                                     "memory up to this many captions and streamed from shards above it, as a "
                                     "CLIP-like student's images always are (null: always in memory).")
    shuffle_window: int = Field(4096, ge=2, description="Streamed pairs: each epoch takes the shards in a seeded "
                                "order and shuffles windows of this many consecutive pairs; memory holds a "
                                "window's ids and the shards it touches.")
    loader_workers: int = Field(2, ge=0, description="DataLoader worker processes that read streamed batches "
                                "(and decode, crop and preprocess a CLIP-like student's images); 0: in the "
                                "training process.")
    checkpoint_every: int = Field(500, ge=0, description="Steps between the checkpoints taken within an epoch "
                                  "(0: only at each epoch's end). A killed run resumes from the newest one, at "
                                  "the next batch of that epoch.")

    @model_validator(mode="after")
    def _student(self) -> TrainingSpec:
        if self.model is not None and self.model.backend != "transformers-clip":
            raise ValueError("training.model.backend must be 'transformers-clip' (or leave training.model unset)")
        return self
