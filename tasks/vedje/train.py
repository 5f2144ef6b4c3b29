"""The vedje-train stage: the joint reranker trained on the cached features, with recall per epoch."""

from __future__ import annotations

import json

import pyarrow as pa
import torch

from rde.training.training_log import step_log_table
from rde.vedje.model_store import load_model, load_tensors, model_folder, save_model
from rde.vedje.training import build_model, evaluate_precisions, frozen_compressor_config, train_config, train_vedje
from storage.schemas import RECALL, TRAINING_LOG
from tasks.framework.accounting import StageResult
from tasks.framework.reporting import Progress, log, rounded_rows
from tasks.framework.stage import Lineage, Report, Resources, Stage, StageRun, Work, Write


class VedjeTrain(Stage):
    """Train (resuming per epoch), evaluate stage 1 vs rerank on the test split, save the model. Its
    input is the training split's queries, counted from the ``vedje_queries`` artifact's ``split``
    column; accepted are those the trainer was given: a query its loader drops fails the stage."""

    name = "vedje-train"
    version = "1"
    reads = ("vedje_frames", "vedje_items", "vedje_queries")
    writes = (Write("vedje_log", "training_log", TRAINING_LOG), Write("vedje_evaluation", "evaluation", RECALL))
    config = ("vedje",)
    resources = Resources(device="gpu", hold_slot=False, batch_size="vedje.batch_size")
    main = "vedje_log"
    balance = True

    def lineage(self, run: StageRun) -> Lineage:
        frozen = None  # the compressor kept from the previous run is an input when it is not retrained
        if not run.section("vedje").train_compressor:
            meta_file = model_folder(run.ctx.profile, run.ctx.output_root) / "model.json"
            if not meta_file.exists():
                raise FileNotFoundError(f"vedje.train_compressor=false keeps the previous compressor, but there is "
                                        f"no trained model at {meta_file.parent}: run `rde train-vedje` once first")
            frozen = json.loads(meta_file.read_text())["cache_lineage"]["compressor"]
        return Lineage(extra={"frozen_compressor": frozen})

    def run(self, run: StageRun) -> Work:
        ctx, spec = run.ctx, run.section("vedje")
        cfg, folder = train_config(spec), model_folder(ctx.profile, ctx.output_root)
        data = load_tensors({n: run.input(f"vedje_{n}").url for n in ("frames", "items", "queries")})
        torch.manual_seed(spec.seed)
        model = build_model(spec, data.frame_features.shape[2], data.frame_features.shape[1],
                            data.item_frames.shape[1], data.item_emb.shape[1])
        run_cfg = cfg
        if not spec.train_compressor:
            run_cfg = frozen_compressor_config(model, load_model(ctx.profile, ctx.output_root)[0], cfg)
            log(f"vedje-train: compressor {model.compressor_fingerprint()[:12]} kept frozen (caches stay valid)")
        with Progress(f"{ctx.flow_name}-train-progress", "vedje-train: training steps done", stage="vedje-train",
                      total=None, unit="steps") as progress:
            result = train_vedje(model, data, run_cfg, folder / "checkpoints" / run.key[:16],
                                 on_epoch=lambda e, loss: log(f"vedje-train: epoch {e} mean loss {loss:.4f}"),
                                 on_step=progress.update)
        meta = save_model(model, folder, ctx.profile, data.item_emb.shape[1])
        rows = evaluate_precisions(model, data, spec.candidates, spec.score_batch)
        n_train = len(data.rows("train")[1])
        stats = {"input_rows": run.input("vedje_queries").count_equal("split", "train"), "accepted": n_train,
                 "rejected": {}, "resumed_from_epoch": result.resumed_from,
                 "epoch_loss": [round(v, 5) for v in result.epoch_loss], "seconds": round(result.seconds, 1),
                 "vtm_share": round(result.vtm_share, 4),
                 "compressor": meta["cache_lineage"]["compressor"]}
        return Work.one({"vedje_log": step_log_table(result.step_losses),
                         "vedje_evaluation": pa.Table.from_pylist(rows, schema=RECALL)}, stats)

    def report(self, run: StageRun, result: StageResult) -> Report:
        folder = model_folder(run.ctx.profile, run.ctx.output_root)
        evaluation = run.output_artifact("vedje_evaluation").rows()
        losses = result.stats.get("epoch_loss", [])
        loss = "\n".join(["# train-vedje: loss per epoch", "", "| epoch | loss |", "|---|---|",
                          *[f"| {i} | {v:.4f} |" for i, v in enumerate(losses)], "",
                          f"Weights: `{folder / 'model.pt'}`"])
        return Report(tables=[("evaluation", rounded_rows(evaluation, 2),
                               "Stage-1 vs VEDJE rerank on the test split: R@1/5/10 per N_c and cache precision")],
                      markdown=[("loss", loss, "VEDJE training loss")],
                      log=f"vedje-train: {len(evaluation)} evaluation rows; model in {folder}")
