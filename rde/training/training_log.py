"""What a training run leaves besides its model: the per-step loss log, the loss curve, the GMM
confidence statistics and histogram (GTR+ Sec. 4.2), and the torch thread count it runs under."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from rde.training.retrieval_training import (
    EpochRecord,
    TrainResult,
)
from storage.schemas import TRAINING_LOG


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Train on ``count`` torch threads (the float sums, and so the steps, do not depend on the
    machine's core count), then give the process back the count it had: later stages and other
    flows in the same process keep theirs."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def step_log_table(step_losses: Sequence[dict[str, Any]]) -> pa.Table:
    """A training run's per-step losses as ``TRAINING_LOG`` rows (the loss terms as JSON), for SAFT, GTR+ and VEDJE."""
    return pa.Table.from_pylist([{"step": int(s["step"]), "epoch": int(s["epoch"]),
                                  "terms": json.dumps({k: v for k, v in s.items() if k not in ("step", "epoch")})}
                                 for s in step_losses], schema=TRAINING_LOG)


def loss_plot(result: TrainResult, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for term in sorted({k for s in result.step_losses for k in s} - {"step", "epoch"}):
        ax.plot([s["step"] for s in result.step_losses if term in s], [s[term] for s in result.step_losses
                                                                         if term in s], label=term)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())


def gmm_epoch_stats(e: EpochRecord) -> dict[str, Any]:
    """What the GMM refit after an epoch decided (kept in the log manifest): its means, the share
    judged clean, the range of confidences, and the mean weight the epoch itself trained with."""
    return {"epoch": e.epoch, "means": [round(m, 5) for m in e.gmm_means], "em_iterations": e.gmm_iterations,
            "clean_share": e.clean_share,
            "confidence_min": float(e.confidence.min()), "confidence_max": float(e.confidence.max()),
            "weight_mean_during_epoch": e.weight_mean}


def gmm_plot(result: TrainResult, path: Path) -> None:
    """Per epoch: ŝ histograms of pairs assigned clean vs noisy, and the gap of their means (GTR+ Fig. 7)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [e for e in result.epochs if e.s_hat is not None]
    fig, axes = plt.subplots(1, len(epochs), figsize=(3 * len(epochs), 2.8), squeeze=False)
    for ax, e in zip(axes[0], epochs, strict=True):
        clean = e.confidence > 0.5
        ax.hist(e.s_hat[clean], bins=30, alpha=0.6, label="clean")
        ax.hist(e.s_hat[~clean], bins=30, alpha=0.6, label="noisy")
        gap = (e.s_hat[clean].mean() - e.s_hat[~clean].mean()) if clean.any() and (~clean).any() else float("nan")
        ax.set_title(f"epoch {e.epoch}: gap {gap:.3f}", fontsize=9)
        ax.set_xlabel("ŝ")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
