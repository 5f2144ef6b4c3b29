"""Training loop for the retrieval dual encoder: SAFT objectives and baselines, GTR+ confidence
weighting and baselines, AdamW with warmup + cosine, checkpoints every N steps and at each epoch's
end with resume mid-epoch (``rde.training.checkpoints``), data-parallel over ranks
(``rde.training.distributed``), seeded and deterministic on the CPU.

A source of pairs gives each epoch's batches (``Batch``) from a position on. ``TrainingPairs``
holds cached features in memory (the CPU model): ``images`` holds V augmented views of each image's
tower features, so "random resized crop" augmentation costs no tower forward during training, and
each step takes one random view per pair. ``rde.training.pair_batches.StreamedTraining`` streams a
CLIP-like student's pairs from shards, decoded and cropped in DataLoader workers.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from models.retrieval.losses import (
    cusa_loss,
    hard_negative_itc,
    iss_loss,
    itc_loss,
    saft_loss,
    sass_loss,
    weighted_itm_loss,
)
from rde.training.checkpoints import CheckpointStore
from rde.training.distributed import Ranks, average_gradients, current, gather_rows, local_part
from rde.training.gmm_confidence import ConfidenceFit, confidence_weights, pair_confidence
from rde.training.pair_batches import Batch, LoaderClock, StreamedTraining
from rde.training.pair_stream import steps_per_epoch

Objective = Literal["itc", "itc+sass", "saft", "cusa", "hnm", "itc+iss"]
Weighting = Literal["none", "fix", "ada"]


@dataclass
class TrainingPairs:
    """The training pairs in memory, over cached tower features (the CPU model): ``images`` V×N_img×D
    tower features of V views, ``texts`` P×d text features, ``pair_image`` P image indices, teacher
    vectors for images (N_img×t) and texts (P×t), ``q_txt`` P confidences. Each step takes one
    random view per pair. (A CLIP-like student reads images: ``rde.training.pair_stream``.)"""

    images: torch.Tensor
    pair_image: torch.Tensor
    texts: torch.Tensor
    teacher_images: torch.Tensor | None = None
    teacher_texts: torch.Tensor | None = None
    q_txt: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # unit teacher vectors once here, not in every training step
        if self.teacher_images is not None:
            self.teacher_images = torch.nn.functional.normalize(self.teacher_images, dim=-1)
        if self.teacher_texts is not None:
            self.teacher_texts = torch.nn.functional.normalize(self.teacher_texts, dim=-1)

    def __len__(self) -> int:
        return len(self.pair_image)

    @property
    def n_views(self) -> int:
        return self.images.shape[0]

    def batch(self, idx: torch.Tensor, views: torch.Tensor, ranks: Ranks | None = None,
              other_view: bool = False) -> Batch:
        """The step's ``Batch`` for global batch ``idx`` (pair ids) with these views: this rank's
        part of the model inputs, the global ids and teacher vectors."""
        image_rows = self.pair_image[idx]
        mine = local_part(torch.arange(len(idx)), ranks)
        other = (views + 1) % self.n_views
        return Batch(pairs=idx, image_keys=image_rows, images=self.images[views[mine], image_rows[mine]],
                     texts=self.texts[idx[mine]],
                     other_images=self.images[other[mine], image_rows[mine]] if other_view else None,
                     teacher_images=None if self.teacher_images is None else self.teacher_images[image_rows],
                     teacher_texts=None if self.teacher_texts is None else self.teacher_texts[idx])

    def steps_per_epoch(self, batch_size: int) -> int:
        return steps_per_epoch(len(self), batch_size)

    def epoch_batches(self, epoch: int, start_position: int, cfg: TrainConfig, ranks: Ranks | None,
                      device: torch.device) -> Iterator[tuple[int, Batch]]:
        """(position after the batch, the batch) of the epoch's seeded order from ``start_position``:
        a permutation and a view per pair, drawn from (seed, epoch) alone, so a resumed epoch goes on
        exactly where the killed one stopped."""
        gen = torch.Generator().manual_seed(cfg.seed + 1000 * epoch)
        order = torch.randperm(len(self), generator=gen)
        views = torch.randint(self.n_views, (len(self),), generator=gen)
        for start in range(start_position, len(self), cfg.batch_size):
            idx = order[start:start + cfg.batch_size]
            if len(idx) >= 2:
                yield start + len(idx), self.batch(idx, views[idx], ranks, cfg.objective == "itc+iss").to(device)

    @torch.no_grad()
    def positive_cosines(self, model: Any, batch: int = 4096) -> np.ndarray:
        """s of every training pair (original view) under the current model."""
        out = []
        for start in range(0, len(self), batch):
            rows = self.pair_image[start:start + batch]
            img = model.encode_image(self.images[0, rows])
            out.append((img * model.encode_text(self.texts[start:start + len(rows)])).sum(dim=1).numpy())
        return np.concatenate(out) if out else np.zeros(0)


PairSource = TrainingPairs | StreamedTraining


@dataclass
class TrainConfig:
    objective: Objective = "itc"
    weighting: Weighting = "none"  # GTR+: none | fix (w = q_txt) | ada (GMM confidence^β)
    use_itm: bool = False  # GTR+ adds the ITM loss (weighted like ITC)
    epochs: int = 5
    batch_size: int = 64
    lr_start: float = 5e-7  # SAFT: linear warmup from 5e-7 to 5e-6 over 10 % of steps, then cosine
    lr_peak: float = 5e-6
    warmup_frac: float = 0.1
    weight_decay: float = 0.05
    tau_teacher: float = 0.05  # τ_o of SAFT Eq. 5 and 7
    alpha: float = 1.0  # SASS weight (Eq. 10)
    beta: float = 0.75  # ISD weight (Eq. 10)
    hnm_margin: float = 0.0  # Eq. 2 β
    hnm_top_k: int = 8
    gamma: float = 0.2  # GTR+ Eq. 7
    confidence_beta: float = 0.8  # GTR+ Eq. 10 β
    gmm_components: int = 2
    gmm_min_fit_pairs: int = 10  # a population (with / without q_txt) smaller than this is not fitted
    seed: int = 0
    checkpoint_every: int = 0  # steps between mid-epoch checkpoints (0: at the end of each epoch only)


@dataclass
class EpochRecord:
    epoch: int
    mean_loss: float
    seconds: float
    gmm_means: list[float] = field(default_factory=list)
    gmm_iterations: list[int] = field(default_factory=list)  # EM iterations of each fit (fewer: warm-started)
    clean_share: float | None = None
    s_hat: np.ndarray | None = None  # ŝ of every pair at the refit (for the histogram plot)
    confidence: np.ndarray | None = None
    weight_mean: float = 1.0  # mean loss weight C^β applied during this epoch (1 before the first fit)


@dataclass
class TrainResult:
    step_losses: list[dict[str, float]]
    epochs: list[EpochRecord]
    resumed_from: int  # the epoch the run started in (0: from scratch, or resumed within epoch 0)
    resumed_step: int = 0  # the step of the checkpoint it resumed from (0: none)
    loader: LoaderClock = field(default_factory=LoaderClock)  # time spent waiting for batches


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup lr_start → lr_peak over ``warmup_frac`` of the steps, then cosine to 0."""
    warm = max(1, round(cfg.warmup_frac * total))
    if step < warm:
        return cfg.lr_start + (cfg.lr_peak - cfg.lr_start) * step / warm
    progress = (step - warm) / max(1, total - warm)
    return 0.5 * cfg.lr_peak * (1.0 + math.cos(math.pi * min(1.0, progress)))


def batch_loss(model: Any, pairs: TrainingPairs, idx: torch.Tensor, views: torch.Tensor,
               cfg: TrainConfig, weights: torch.Tensor | None, ranks: Ranks | None = None) -> dict[str, torch.Tensor]:
    """``loss_terms`` of global batch ``idx`` of in-memory pairs with these views."""
    return loss_terms(model, pairs.batch(idx, views, ranks, cfg.objective == "itc+iss"), cfg, weights, ranks)


def loss_terms(model: Any, batch: Batch, cfg: TrainConfig, weights: torch.Tensor | None,
               ranks: Ranks | None = None) -> dict[str, torch.Tensor]:
    """All loss terms of one batch for the configured objective; ``total`` is what is optimised.
    With ``ranks`` (data-parallel training, ``rde.training.distributed``) this process encodes its
    part of the batch, and the terms are those of the whole gathered batch."""
    img = gather_rows(model.encode_image(batch.images), ranks)
    txt = gather_rows(model.encode_text(batch.texts), ranks)
    tau = model.tau
    out: dict[str, torch.Tensor] = {}
    t_img, t_txt = batch.teacher_images, batch.teacher_texts
    if cfg.objective == "saft":  # the fused pass: shared student logits, teacher terms without autograd
        out = saft_loss(img, txt, tau, t_img, t_txt, cfg.tau_teacher, cfg.alpha, cfg.beta, weights)
        total = out.pop("total")
    else:
        out["itc"] = hard_negative_itc(img, txt, tau, cfg.hnm_margin, cfg.hnm_top_k) if cfg.objective == "hnm" \
            else itc_loss(img, txt, tau, weights)
        total = out["itc"]
        if cfg.objective == "cusa":
            out["cusa"] = cusa_loss(img, txt, tau, t_img, t_txt, cfg.tau_teacher)
            total = total + cfg.alpha * out["cusa"]
        elif cfg.objective == "itc+sass":
            out["sass"] = sass_loss(img, txt, tau, t_img, t_txt, cfg.tau_teacher)
            total = total + cfg.alpha * out["sass"]
        elif cfg.objective == "itc+iss":
            out["iss"] = iss_loss(img, gather_rows(model.encode_image(batch.other_images), ranks), tau)
            total = total + out["iss"]
    if cfg.use_itm:
        n = len(batch.pairs)
        with torch.no_grad():
            sims = img @ txt.T
            same = batch.image_keys[:, None] == batch.image_keys[None, :]
            hardest = sims.masked_fill(same, float("-inf")).argmax(dim=1)
        logits = torch.cat([model.itm_logits(img, txt), model.itm_logits(img, txt[hardest])])
        labels = torch.cat([torch.ones(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)]).to(img.device)
        pos_w = None if weights is None else torch.cat([weights, torch.ones_like(weights)])
        out["itm"] = weighted_itm_loss(logits, labels, pos_w)
        total = total + out["itm"]
    out["total"] = total
    return out


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer, epoch: int, step: int, position: int | None,
           epoch_losses: list[float], weights: torch.Tensor | None, gmm: ConfidenceFit | None) -> dict[str, Any]:
    """A checkpoint: ``position`` is where the epoch's seeded order goes on (None: the epoch is
    done); the learning rate needs no state of its own, it is ``lr_at(step)``."""
    return {"model": model.state_dict(), "optimizer": optim.state_dict(), "epoch": epoch, "step": step,
            "position": position, "epoch_losses": list(epoch_losses), "weights": weights,
            "torch_rng": torch.get_rng_state(), "gmm": None if gmm is None else gmm.state()}


def train(model: torch.nn.Module, pairs: PairSource, cfg: TrainConfig,
          checkpoint_dir: Path | str | None = None, on_step: Callable[[int, int], None] | None = None,
          on_loss: Callable[[dict[str, float]], None] | None = None) -> TrainResult:
    """Train in place. With ``checkpoint_dir`` (a folder or an object-store URL) a checkpoint is
    saved every ``cfg.checkpoint_every`` steps and at the end of every epoch, and a rerun resumes
    from the newest one: mid-epoch, it goes on at the next batch of the epoch's seeded order, with
    the optimiser, the step (so the schedule), the epoch's losses, the weights, the GMM fits that
    warm-start the next refit and the RNG state as they were, so the pairs of that epoch are each
    seen once and the result is the uninterrupted run's. ``on_step(steps done, steps in all)`` after
    every step, for progress displays, and ``on_loss(the step's loss terms, with its step and
    epoch)``, for live loss curves."""
    torch.manual_seed(cfg.seed)
    ranks = current()  # in a process group: data-parallel, every rank with the same seeded order
    leader = ranks is None or ranks.rank == 0  # the one that reports progress and saves checkpoints
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg.lr_start, weight_decay=cfg.weight_decay)
    # a batch of one pair has no in-batch negative and is skipped, so it is not a step: the schedule
    # and the progress total count only the batches that train (17 pairs in batches of 8: 2 a epoch)
    total = max(1, pairs.steps_per_epoch(cfg.batch_size) * cfg.epochs)
    if cfg.weighting == "fix":
        if pairs.q_txt is None:
            raise ValueError("FixWeight needs q_txt for every pair")
        weights: torch.Tensor | None = torch.nan_to_num(pairs.q_txt, nan=1.0).float()
    else:
        weights = None  # ada: 1 until the first GMM fit
    start_epoch, step, position, resumed_losses = 0, 0, 0, []
    gmm: ConfidenceFit | None = None  # the previous epoch's fits warm-start the next (checkpointed too)
    store = CheckpointStore(str(checkpoint_dir)) if checkpoint_dir is not None else None
    state = store.latest() if store is not None else None
    if state is not None:
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optimizer"])
        step, weights = state["step"], state["weights"]
        torch.set_rng_state(state["torch_rng"])
        gmm = ConfidenceFit.from_state(state.get("gmm"))  # checkpoints before the fits were kept: None
        if state["position"] is None:
            start_epoch = state["epoch"] + 1
        else:
            start_epoch, position, resumed_losses = state["epoch"], state["position"], list(state["epoch_losses"])
    losses: list[dict[str, float]] = []
    records: list[EpochRecord] = []
    clock = LoaderClock()
    for epoch in range(start_epoch, cfg.epochs):
        began = time.perf_counter()
        epoch_losses: list[float] = resumed_losses if epoch == start_epoch else []
        model.train()
        batches = pairs.epoch_batches(epoch, position if epoch == start_epoch else 0, cfg, ranks, device)
        for at, batch in clock.timed(batches):
            for group in optim.param_groups:
                group["lr"] = lr_at(step, total, cfg)
            batch_weights = None if weights is None else weights[batch.pairs.cpu()].to(device)
            terms = loss_terms(model, batch, cfg, batch_weights, ranks)
            optim.zero_grad()
            terms["total"].backward()
            average_gradients(params, ranks)
            optim.step()
            step += 1
            if on_step is not None and leader:
                on_step(step, total)
            losses.append({k: float(v.detach()) for k, v in terms.items()} | {"step": step, "epoch": epoch})
            if on_loss is not None and leader:
                on_loss(losses[-1])
            epoch_losses.append(float(terms["total"].detach()))
            if store is not None and leader and cfg.checkpoint_every and step % cfg.checkpoint_every == 0 \
                    and at < len(pairs):
                store.save(_state(model, optim, epoch, step, at, epoch_losses, weights, gmm))
        record = EpochRecord(epoch, float(np.mean(epoch_losses)) if epoch_losses else 0.0, 0.0,
                             weight_mean=float(weights.mean()) if weights is not None else 1.0)
        if cfg.weighting == "ada":
            model.eval()
            q = pairs.q_txt.numpy() if pairs.q_txt is not None else np.full(len(pairs), np.nan)
            conf, s_hat, gmm = pair_confidence(pairs.positive_cosines(model), q, cfg.gamma, cfg.gmm_components,
                                               gmm, cfg.gmm_min_fit_pairs)
            weights = torch.tensor(confidence_weights(conf, cfg.confidence_beta), dtype=torch.float32)
            fitted = gmm.with_q_txt or gmm.cosine_only
            record.gmm_means = fitted.means.tolist() if fitted is not None else []
            record.gmm_iterations = gmm.iterations
            record.clean_share = float((conf > 0.5).mean())
            record.s_hat, record.confidence = s_hat, conf
        record.seconds = time.perf_counter() - began
        records.append(record)
        if store is not None and leader:
            store.save(_state(model, optim, epoch, step, None, [], weights, gmm))
    return TrainResult(losses, records, start_epoch, state["step"] if state is not None else 0, clock)


def train_data_parallel(model: torch.nn.Module, pairs: PairSource, cfg: TrainConfig, processes: int,
                        workdir: Path, checkpoint_dir: Path | str | None = None,
                        on_step: Callable[[int, int], None] | None = None,
                        on_loss: Callable[[dict[str, float]], None] | None = None) -> TrainResult:
    """``train`` in ``processes`` ranks on this machine (``rde.training.distributed``): every rank
    starts from ``model``'s weights and the same seeded order, each step's global batch is shared
    out and its loss taken over the gathered batch; rank 0 saves the checkpoints and hands the
    trained weights and the result back, which land in ``model``. A model on a CUDA device trains
    with ``nccl``, rank r on GPU r (``processes`` at most the GPUs there are); otherwise ``gloo`` on
    the CPU. ``workdir`` holds the rendezvous and the hand-over file."""
    from rde.training.distributed import run_group

    device = next(model.parameters()).device
    if device.type == "cuda" and processes > torch.cuda.device_count():
        raise ValueError(f"training.processes is {processes} but this machine has {torch.cuda.device_count()} GPUs")
    workdir.mkdir(parents=True, exist_ok=True)
    rendezvous, out = workdir / "rendezvous", workdir / "rank0.pt"
    for stale in (rendezvous, out):
        stale.unlink(missing_ok=True)
    context = torch.multiprocessing.get_context("spawn")
    done, total, step_losses = context.Value("q", 0), context.Value("q", 0), context.SimpleQueue()

    def poll() -> None:  # in this process, while the ranks train: rank 0's progress and losses
        while not step_losses.empty():
            record = step_losses.get()
            if on_loss is not None:
                on_loss(record)
        if on_step is not None and total.value:
            on_step(int(done.value), int(total.value))

    run_group(_rank_train, processes, str(rendezvous), "nccl" if device.type == "cuda" else "gloo", model.cpu(),
              pairs, cfg, checkpoint_dir, device.type, done, total, step_losses, str(out), on_poll=poll)
    handed = torch.load(out, weights_only=False, map_location="cpu")
    model.load_state_dict(handed["model"])
    model.to(device)
    return handed["result"]


def _rank_train(rank: int, world: int, model: torch.nn.Module, pairs: PairSource, cfg: TrainConfig,
                checkpoint_dir: Path | str | None, device_type: str, done: Any, total: Any, step_losses: Any,
                out: str) -> None:
    def progress(steps: int, steps_in_all: int) -> None:
        done.value, total.value = steps, steps_in_all

    # torch hands tensors to spawned processes in shared memory: without a private copy every rank's
    # optimiser would step the same weights
    model = copy.deepcopy(model)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        model.to(torch.device("cuda", rank))
    result = train(model, pairs, cfg, checkpoint_dir, progress, step_losses.put)
    if rank == 0:
        torch.save({"model": model.state_dict(), "result": result}, out)
