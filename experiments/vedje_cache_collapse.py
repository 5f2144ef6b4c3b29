"""Which VEDJE training term makes the caches of different items nearly equal? A controlled check
behind ``vedje_convergence.py``'s finding that the stored caches of a person and its stage-1 hard
negatives have cosine ≈ 0.99 throughout training, where the frozen features have 0.68.

Same data, split, model and schedule as ``vedje_convergence.py`` (the demo person images, stage 1 =
the attributes expert, the validation split by identity; ``--compressor-norm`` as there). One model
per condition, the same seed, trained ``--epochs`` epochs with only some loss terms (the
compressor gets gradient from VTM, through the joint score, and from MLM, whose masked text
attends to the positive's cache; VTC is text-only and the future-delta term needs T > 3, so
neither reaches the compressor on images):

- ``vtm+vtc+mlm``: the recipe (all terms that apply to images);
- ``vtm``: VTM alone;
- ``vtm, ρ hidden``: VTM alone with ρ = 0 fed to the scorer (the content path is its only way);
- ``mlm``: MLM alone;
- ``vtc``: VTC alone (no gradient reaches the compressor: its caches must stay as initialised —
  the control that the measurement itself does not move);
- ``vtm+vtc+mlm+structure`` and ``vtm+structure, ρ hidden``: the same with the experiment-only
  cache-structure term (``models.reranker.losses.cache_structure_loss``, weight
  ``--structure-weight``; not the paper's recipe): the positive control — if the caches are kept
  as distinct as the frozen features, does the content path learn (pairs right with ρ zeroed
  above 50, a ρ-hidden VTM loss below ln 4)?

After every epoch, on the validation lists (stage-1 top-20): the mean positive–negative cosine of
the stored BF16 caches, the pairs the score orders right with ρ zeroed (chance 50), the validation
VTM loss, and the RMS of the learned cache queries Q_0 and of W_kv (what each term does to the
compressor's two inputs). Then whether the joint encoder reads the cache at all (``joint_response``),
on a grid of 20 validation queries × their positives, every pair: the [CLS]'s attention mass on the
cache tokens (last layer and all layers, against an even spread over the tokens), and how much of
the final [CLS] state c(q, v) and of the score with ρ = 0 varies with the query, with the item
(the cache) and with the two together (two-way sums of squares; only the interaction can rank one
query's candidates differently from another's), with each grid's absolute spread. Prints one table
per condition and a summary. ≈ 1–2 min per epoch and condition on the 2-core machine (an MLM- or
VTC-only epoch is shorter): the default (7 conditions × 3 epochs) ≈ 20–30 min.

``--readout mean`` reads c(q, v) as the mean of every unpadded token's final state instead of the
[CLS] (a control for the finding that this encoder's [CLS] hardly varies; not the paper's model).
``--blocks random`` re-draws the joint encoder's transformer blocks (attention and feed-forward)
with BERT's initialisation and keeps its pretrained token embeddings (``redraw_blocks``): a control
for the reading that the pretrained sentence encoder is what keeps caption and cache apart.

    .venv/bin/python experiments/vedje_cache_collapse.py [--epochs 3] [--compressor-norm post|pre] [--readout cls|mean]
        [--blocks pretrained|random]
        [--conditions "vtm+vtc+mlm" vtm ...] [--structure-weight 1] [--seed 0] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from vedje_convergence import (
    SOURCES,
    TINY,
    Loader,
    content_signal,
    load_source,
    model_spec,
    new_model,
    tiny_subset,
    validation_split,
)

from models.reranker.vedje import Vedje
from rde.vedje.training import VedjeTensors, stored_caches, train_config, train_vedje, validation_vtm_loss
from storage.locations import state_dir

# condition → (loss terms, ρ hidden)
CONDITIONS: dict[str, tuple[tuple[str, ...], bool]] = {
    "vtm+vtc+mlm": (("vtm", "vtc", "mlm"), False),
    "vtm": (("vtm",), False),
    "vtm, ρ hidden": (("vtm",), True),
    "mlm": (("mlm",), False),
    "vtc": (("vtc",), False),
    "vtm+vtc+mlm+structure": (("vtm", "vtc", "mlm", "structure"), False),
    "vtm+structure, ρ hidden": (("vtm", "structure"), True),
}


def rms(t: torch.Tensor) -> float:
    return float(t.detach().float().pow(2).mean().sqrt())


def _centred(grid: np.ndarray) -> np.ndarray:
    """A Q×C(×D) grid as Q×C×D float64 minus its mean over the Q·C cells."""
    g = grid.reshape(grid.shape[0], grid.shape[1], -1).astype(np.float64)
    return g - g.mean(axis=(0, 1), keepdims=True)


def two_way_shares(grid: np.ndarray) -> tuple[float, float, float]:
    """Shares (%) of a Q×C(×D) grid's sum of squares about its mean from the query effect, the item
    effect and their interaction (two-way ANOVA without replication, summed over D): SS = C·Σa_q² +
    Q·Σb_v² + Σ(ab)_qv², the three parts orthogonal. Only the interaction depends on the query and
    the item together: a score without it ranks every query's candidates the same way."""
    g = _centred(grid)
    a, b = g.mean(axis=1, keepdims=True), g.mean(axis=0, keepdims=True)
    inter = g - a - b
    total = float((g ** 2).sum())
    if total == 0.0:
        return float("nan"), float("nan"), float("nan")
    q, c = g.shape[:2]
    return (100.0 * c * float((a ** 2).sum()) / total, 100.0 * q * float((b ** 2).sum()) / total,
            100.0 * float((inter ** 2).sum()) / total)


def grid_sd(grid: np.ndarray) -> float:
    """The grid's spread in absolute terms: √(SS / (Q·C)), SS the sum of squares about its mean
    (summed over D for vectors) — the scale that ``two_way_shares`` divides out."""
    g = _centred(grid)
    return float(np.sqrt((g ** 2).sum() / (g.shape[0] * g.shape[1])))


def response_grid(data: VedjeTensors, n: int) -> tuple[list[int], list[int]]:
    """(query rows, item rows) of the check grid: the first ``n`` validation queries whose positives
    are distinct items, and those positives (so each query's match is on the grid's diagonal)."""
    queries, items = [], []
    for q in data.rows("val")[1]:
        item = data.items.query_items[q]
        if item not in items:
            queries.append(q)
            items.append(item)
        if len(queries) == n:
            break
    return queries, items


def joint_response(model: Vedje, data: VedjeTensors, n: int) -> dict[str, float]:
    """Does the joint encoder's [CLS] respond to which cache is in context? On a grid of ``n``
    validation queries × their ``n`` positives (every pair, stored BF16 caches): the [CLS]'s
    attention mass on the cache tokens per layer (mean over pairs and heads; ``uniform``: the mass
    if it attended evenly to the unpadded tokens, K/(L+K)), and the two-way shares (query / item /
    interaction, %) of the joint states c(q, v) the score reads and of the scores with ρ = 0, with
    each grid's absolute spread (``grid_sd``: a share of a near-constant score is a share of
    nothing). Attention is read with the eager kernel (SDPA returns no weights; the states agree
    to float rounding)."""
    queries, items = response_grid(data, n)
    if len(queries) < 2:
        return {}
    reranker, bert = model.reranker, model.reranker.bert
    model.eval()
    caught: list[torch.Tensor] = []
    hooks = [block.attention.self.register_forward_hook(lambda _m, _i, out: caught.append(out[1].detach()))
             for block in bert.encoder.layer]
    kernel = bert.config._attn_implementation
    bert.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            text = reranker.tokenize([data.items.query_texts[q] for q in queries])
            caches = stored_caches(model, data, "bf16")(items).to(reranker.device)
            rows = torch.arange(len(queries)).repeat_interleave(len(items))
            states = reranker.joint_state(text, rows, caches.repeat(len(queries), 1, 1))
            scores = reranker.score_state(states, torch.zeros(len(rows)))
    finally:
        bert.set_attn_implementation(kernel)
        for hook in hooks:
            hook.remove()
    k = caches.shape[1]
    lengths = text.mask[rows].sum(1).float()
    on_cache = [float(w[:, :, 0, -k:].sum(-1).mean()) for w in caught]  # per layer: N×heads×(L+K)×(L+K)
    shape = (len(queries), len(items))
    c_grid = states.float().cpu().numpy().reshape(*shape, -1)
    s_grid = scores.float().cpu().numpy().reshape(shape)
    c_shares, s_shares = two_way_shares(c_grid), two_way_shares(s_grid)
    return {"attn_cache_last": 100.0 * on_cache[-1], "attn_cache_mean": 100.0 * float(np.mean(on_cache)),
            "attn_uniform": 100.0 * float((k / (lengths + k)).mean()),
            "c_query": c_shares[0], "c_item": c_shares[1], "c_inter": c_shares[2],
            "s_query": s_shares[0], "s_item": s_shares[1], "s_inter": s_shares[2],
            "c_sd": grid_sd(c_grid), "s_sd": grid_sd(s_grid)}


def measure(model: Vedje, data: VedjeTensors, cfg: Any, n_val: int, epoch: int, step: int) -> dict[str, Any]:
    """One row of a condition's table (leaves the model in eval mode)."""
    cosine, pairs = content_signal(model, data, n_val)
    val_vtm, _ = validation_vtm_loss(model, data, cfg)
    return {"epoch": epoch, "step": step, "cache_cos": cosine, "rho0_pairs": pairs, "val_vtm": val_vtm,
            "q0_rms": rms(model.compressor.queries), "wkv_rms": rms(model.compressor.kv_proj.weight),
            **joint_response(model, data, n_val)}


def redraw_blocks(bert: torch.nn.Module, std: float, seed: int) -> int:
    """Re-initialise every transformer block of ``bert`` as BERT initialises a new model (Linear
    weights N(0, ``std``), biases 0, LayerNorm weight 1 and bias 0), keeping the embeddings.
    Returns how many parameters were re-drawn. Experiment-only (``--blocks random``)."""
    generator = torch.Generator().manual_seed(seed)
    drawn = 0
    with torch.no_grad():
        for block in bert.encoder.layer:
            for module in block.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                    if module.bias is not None:
                        module.bias.zero_()
                elif isinstance(module, torch.nn.LayerNorm):
                    module.weight.fill_(1.0)
                    module.bias.zero_()
            drawn += sum(p.numel() for p in block.parameters())
    return drawn


def run_condition(data: VedjeTensors, args: argparse.Namespace, losses: tuple[str, ...], hide_prior: bool
                  ) -> list[dict[str, Any]]:
    """Train one model with ``losses`` for ``--epochs`` epochs; a measurement before and after each."""
    spec = model_spec(args)
    model = new_model(data, args, args.seed)
    model.reranker.readout = args.readout
    if args.blocks == "random":
        bert = model.reranker.bert
        redraw_blocks(bert, float(getattr(bert.config, "initializer_range", 0.02)), args.seed)
    cfg = train_config(spec, epochs=args.epochs, batch_size=args.batch, train_candidates=args.candidates,
                       negatives_from=SOURCES["images"]["negatives_from"], warmup_steps=args.warmup,
                       lr_peak=args.lr, epoch_decay=args.decay, seed=args.seed, losses=losses,
                       hide_prior=hide_prior, structure_weight=args.structure_weight)
    n_val = min(20, len(data.rows("val")[0]))
    rows = [measure(model, data, cfg, n_val, 0, 0)]

    def after_epoch(epoch: int, result: Any) -> bool:
        rows.append(measure(model, data, cfg, n_val, epoch + 1, len(result.step_losses)))
        return False

    train_vedje(model, data, cfg, should_stop=after_epoch)
    return rows


def condition_table(name: str, rows: list[dict[str, Any]]) -> str:
    f = lambda x: "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"  # noqa: E731
    p = lambda r, key: "–" if key not in r or math.isnan(r[key]) else f"{r[key]:.1f}"  # noqa: E731
    g = lambda r, key: "–" if key not in r else f"{r[key]:.2g}"  # noqa: E731
    lines = [f"\n### {name}", "\n| epoch | step | cache cos pos–neg | pairs right, ρ zeroed (%) | val VTM loss "
             "| Q_0 rms | W_kv rms |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['epoch']} | {r['step']} | {f(r['cache_cos'])} | {r['rho0_pairs']:.1f} | {f(r['val_vtm'])} | "
              f"{f(r['q0_rms'])} | {f(r['wkv_rms'])} |" for r in rows]
    lines += ["\nThe [CLS]'s response to the cache (validation queries × their positives, every pair):",
              "\n| epoch | [CLS] attention on cache, last layer (%) | all layers (%) | even spread (%) "
              "| c: query / item / interaction (% of SS) | c sd | s, ρ = 0: query / item / interaction (% of SS) "
              "| s sd |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['epoch']} | {p(r, 'attn_cache_last')} | {p(r, 'attn_cache_mean')} | {p(r, 'attn_uniform')} | "
              f"{p(r, 'c_query')} / {p(r, 'c_item')} / {p(r, 'c_inter')} | {g(r, 'c_sd')} | "
              f"{p(r, 's_query')} / {p(r, 's_item')} / {p(r, 's_inter')} | {g(r, 's_sd')} |" for r in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, load: Loader = load_source) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--conditions", nargs="+", choices=sorted(CONDITIONS), default=list(CONDITIONS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compressor-norm", choices=("post", "pre"), default="post")
    parser.add_argument("--structure-weight", type=float, default=1.0,
                        help="weight of the cache-structure term in the conditions that name it")
    parser.add_argument("--readout", choices=("cls", "mean"), default="cls",
                        help="c(q, v): the final [CLS] state (the paper) or the mean of every token's (a control)")
    parser.add_argument("--blocks", choices=("pretrained", "random"), default="pretrained",
                        help="the joint encoder's transformer blocks as loaded, or re-drawn at BERT's init (a control)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--candidates", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--decay", type=float, default=0.9)
    parser.add_argument("--val-share", type=float, default=0.15)
    parser.add_argument("--encoder", default=None, help="joint encoder id or folder (default: the demo profile's)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.batch, args.candidates = TINY["layers"], TINY["batch"], TINY["candidates"]
    torch.set_num_threads(2)
    try:
        data = load("images", SOURCES["images"])
    except FileNotFoundError as exc:
        print(f"skipped — {exc}")
        return {"skipped": str(exc)}
    if args.tiny:
        data = tiny_subset(data)
    data, counts = validation_split(data, "identity", args.val_share, seed=0)
    print(f"## images, compressor {args.compressor_norm}-norm, readout {args.readout}, blocks {args.blocks}, "
          f"seed {args.seed}, {args.epochs} epochs per condition; train {counts['train_items']} items / "
          f"{counts['train_queries']} queries, validation {counts['val_items']} / {counts['val_queries']}", flush=True)
    report: dict[str, Any] = {"args": vars(args), "counts": counts, "conditions": {}}
    out = state_dir() / "experiments" / "vedje_cache_collapse.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for name in args.conditions:
        losses, hide = CONDITIONS[name]
        t0 = time.perf_counter()
        rows = run_condition(data, args, losses, hide)
        report["conditions"][name] = rows
        print(condition_table(name, rows) + f"\n({time.perf_counter() - t0:.0f}s)", flush=True)
        out.write_text(json.dumps(report, indent=1, default=str))
    print("\n### summary: cache cosine positive–negative, untrained → last epoch; at the last epoch: pairs right "
          "with ρ zeroed, the [CLS]'s attention on the cache (last layer) and the item + interaction share of c "
          "(untrained → last)\n\n| condition | cache cos untrained | last | change | pairs, ρ zeroed (%) "
          "| [CLS] attention on cache (%) | c: item + interaction (% of SS) |\n|---|---|---|---|---|---|---|")
    reads = lambda r: r.get("c_item", math.nan) + r.get("c_inter", math.nan)  # noqa: E731
    for name, rows in report["conditions"].items():
        first, last = rows[0], rows[-1]
        print(f"| {name} | {first['cache_cos']:.4f} | {last['cache_cos']:.4f} | "
              f"{last['cache_cos'] - first['cache_cos']:+.4f} | {last['rho0_pairs']:.1f} | "
              f"{first.get('attn_cache_last', math.nan):.1f} → {last.get('attn_cache_last', math.nan):.1f} | "
              f"{reads(first):.1f} → {reads(last):.1f} |")
    print(f"\n{time.perf_counter() - start:.0f}s; raw results in {out}")
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
