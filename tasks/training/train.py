"""The train stage (``train-saft``, ``train-gtr``): one method's training with per-epoch checkpoints,
evaluation, loss curves and a live loss plot."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import torch

from rde.training.retrieval_training import (
    TrainConfig,
    TrainResult,
    train,
    train_data_parallel,
)
from rde.training.training_data import evaluation_rows, load_training_data, new_model
from rde.training.training_log import gmm_epoch_stats, gmm_plot, loss_plot, step_log_table, torch_threads
from storage.filesystem import join
from storage.schemas import EVALUATION, TRAINING_LOG
from tasks.framework.accounting import StageResult
from tasks.framework.reporting import Progress, inline_png, publish_markdown, rounded_rows
from tasks.framework.stage import Lineage, Report, Resources, Stage, StageRun, Work, Write


class LiveLoss:
    """The loss curve of a training run while it runs: every step's terms are kept, and the curve
    (with a table of the last steps) is republished as one markdown artifact under a stable key at
    most every ``every_s`` seconds, and once more at the end, so the Prefect UI shows it growing."""

    def __init__(self, key: str, title: str, every_s: float = 30.0) -> None:
        self.key, self.title, self.every_s = key, title, every_s
        self.records: list[dict[str, float]] = []
        self.published_at = time.monotonic()
        self.publications = 0

    def add(self, record: dict[str, float]) -> None:
        self.records.append(record)
        if time.monotonic() - self.published_at >= self.every_s:
            self.publish()

    def publish(self) -> None:
        if not self.records:
            return
        with tempfile.TemporaryDirectory() as tmp:
            plot = Path(tmp) / "loss.png"
            loss_plot(TrainResult(self.records, [], 0), plot, self.title)
            picture = inline_png(plot, "training loss so far")
        last = self.records[-5:]
        terms = [k for k in last[-1] if k not in ("step", "epoch")]
        table = ["| step | epoch | " + " | ".join(terms) + " |", "|---|---|" + "---|" * len(terms),
                 *[f"| {int(r['step'])} | {int(r['epoch'])} | " + " | ".join(f"{r.get(t, float('nan')):.4f}"
                                                                            for t in terms) + " |" for r in last]]
        count = f"{len(self.records)} step{'s' if len(self.records) != 1 else ''} so far."
        publish_markdown(self.key, "\n".join([f"# {self.title}: loss so far", "", count, "", picture, "", *table]),
                         f"{self.title}: the loss curve while training runs")
        self.published_at, self.publications = time.monotonic(), self.publications + 1


@dataclass
class Trained:
    """What the training run leaves for the report: its result (None when the stage was skipped)."""

    result: TrainResult | None = None


class Train(Stage):
    """Train (resuming from the last checkpoint of the same configuration), evaluate zero-shot and
    trained, write the step log, the evaluation rows, the final weights and the loss plot. One stage
    per method: its folders are ``train_<method>`` (weights, plots), ``_log`` and ``_evaluation``.
    Its input is the features artifact's training pairs, counted from its ``kind`` column; accepted
    are the pairs the trainer was given: a pair its loader drops fails the stage."""

    version = "2"
    reads = ("training_features",)
    config = ("training", "evaluation")
    resources = Resources(device="gpu", hold_slot=False, batch_size="training.batch_size")
    prepares = Trained
    balance = True

    def __init__(self, method: str, cfg: TrainConfig) -> None:
        self.method, self.cfg = method, cfg
        self.name = f"train_{method}"
        self.log_name, self.evaluation_name = f"{self.name}_log", f"{self.name}_evaluation"
        self.main = self.log_name  # type: ignore[misc]  # per method, as its name
        self.writes = (Write(self.log_name, "training_log", TRAINING_LOG),
                       Write(self.evaluation_name, "evaluation", EVALUATION))

    def lineage(self, run: StageRun) -> Lineage:
        run.prepared = Trained()
        return Lineage(extra={"cfg": self.cfg.__dict__})

    def run(self, run: StageRun) -> Work:
        with torch_threads(2):
            return self._train(run)

    def _train(self, run: StageRun) -> Work:
        ctx, folder = run.ctx, Path(run.output_url(self.name))
        (folder / "s_hat.png").unlink(missing_ok=True)  # a previous configuration's histograms must not show
        features = run.input("training_features")
        data = load_training_data(features.url, ctx.profile)
        torch.manual_seed(self.cfg.seed)
        model = new_model(data, ctx.profile)
        rows = evaluation_rows(model, data, "zero-shot")
        with Progress(f"{ctx.flow_name}-train-progress", f"{self.name}: training steps done", stage=self.name,
                      total=None, unit="steps") as progress:
            checkpoints = join(run.output_url(self.name), "checkpoints", run.key[:16])
            processes = run.section("training").processes
            live = LiveLoss(f"{ctx.flow_name}-{self.name.replace('_', '-')}-live-loss", self.method)
            if processes > 1:
                with tempfile.TemporaryDirectory(prefix="rde-train-group-") as group:
                    result = train_data_parallel(model, data["pairs"], self.cfg, processes, Path(group), checkpoints,
                                                 progress.update, live.add)
            else:
                result = train(model, data["pairs"], self.cfg, checkpoint_dir=checkpoints, on_step=progress.update,
                               on_loss=live.add)
            live.publish()
        rows += evaluation_rows(model, data, self.method)
        torch.save(model.state_dict(), folder / "model.pt")
        loss_plot(result, folder / "loss.png", f"{self.method} ({len(data['pairs'])} pairs)")
        run.prepared.result = result
        counted = features.count_equal("split", "train") if data["streamed"] else features.count_equal("kind", "pair")
        stats = {"input_rows": counted, "accepted": len(data["pairs"]), "rejected": {},
                 "data_stall_share": round(result.loader.stall_share, 4), "batches": result.loader.batches,
                 "resumed_from_epoch": result.resumed_from, "resumed_from_step": result.resumed_step,
                 "epoch_loss": [round(e.mean_loss, 5) for e in result.epochs],
                 "gmm": [gmm_epoch_stats(e) for e in result.epochs if e.confidence is not None]}
        return Work.one({self.log_name: step_log_table(result.step_losses),
                         self.evaluation_name: pa.Table.from_pylist(rows, schema=EVALUATION)}, stats)

    def report(self, run: StageRun, result: StageResult) -> Report:
        folder = Path(run.output_url(self.name))
        evaluation = run.output_artifact(self.evaluation_name).rows()
        epoch_loss = result.stats.get("epoch_loss", [])
        trained = run.prepared.result  # None when the stage was skipped
        if trained is not None and trained.epochs and trained.epochs[-1].s_hat is not None:
            gmm_plot(trained, folder / "s_hat.png")
        plots = [inline_png(folder / png, alt) for png, alt in (("loss.png", "training loss per step"),
                                                                ("s_hat.png", "ŝ of pairs judged clean vs noisy"))
                 if (folder / png).exists()]
        loss = "\n".join([
            f"# {self.method}: training loss", "", "| epoch | mean loss |", "|---|---|",
            *[f"| {i} | {v:.4f} |" for i, v in enumerate(epoch_loss)], "", *[f"{p}\n" for p in plots],
            f"Loss curve `{folder / 'loss.png'}`; weights `{folder / 'model.pt'}`; checkpoints (every "
            f"`training.checkpoint_every` steps and at each epoch's end, keyed by the stage key) "
            f"`{folder / 'checkpoints'}`."])
        return Report(tables=[("evaluation", rounded_rows(evaluation, 4),
                               f"{self.method}: zero-shot vs trained (check set mAP@K per domain; held-out person "
                               "search)")],
                      markdown=[("loss", loss, "Training loss per epoch with the loss curve (and for GTR+ the ŝ "
                                               "histograms) shown inline")],
                      log=f"{self.name}: {len(evaluation)} evaluation rows; artifacts in {folder}")
