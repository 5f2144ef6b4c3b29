"""Can the cached joint reranker (VEDJE) read motion that a frame average cannot see?

Data: the motion clip set of vtest.avi (``entry.motion_clips``): one tracked person per clip,
T frames from one fixed crop window, captioned with measured clothing colours and the direction
they move; each clip's time-reversed twin (same frames, opposite order, opposite direction) is in
the same split. Stage 1 embeds a clip as the normalised mean of its frames' embeddings, so a clip
and its twin get the same stage-1 score: stage 1 is at chance on the pairs by construction.
Relevance: the clips of the same track moving the same way. Split by identity through time.

Per condition, ``--seeds`` seeds (the profile's training settings; the paper's in DESIGN.md):
R@1/5/10 of stage 1 and of stage 1 + rerank at N_c = 20 on the held-out queries, the accuracy on
the reversed-twin pairs (joint score of the query's clip above its twin's; ties count half), and a
bootstrap 95 % interval over queries (seed-averaged hits) for the R@1 gain and the pair accuracy.

Conditions: VEDJE as configured; its models evaluated with each cache's frames shuffled (the gain
must vanish if it comes from order); the delta head off (the paper's ablation); ρ hidden (trained
and evaluated with ρ = 0); T = 1 (one frame per clip: the image case, direction invisible); and an
experiment-only control, the reversed twin always among a training query's VTM candidates (does
a training signal that only order can lower teach the order?).
Diagnostics: linear probes for direction (4 classes) on the frozen backbone's features and on the
trained caches Z, each with the frames in order, as last − first frame, and averaged (order
removed): do the features, and does the cache, hold the direction?
And the joint encoder's response on test queries × their clips (``vedje_cache_collapse``): its
attention on the cache and the interaction share of its scores: does it read the cache jointly?

    .venv/bin/python experiments/vedje_motion.py [--seeds 3] [--epochs 6]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from entry.motion_clips import directions_of, twins_of
from rde.vedje.training import (
    VedjeTensors,
    build_model,
    hits_at,
    joint_scores,
    reranked_order,
    stage1_top,
    stored_caches,
    train_config,
    train_vedje,
)

VIDEO = ".rde/demo-videos/vtest.avi"  # `make videos` fetches it
KS = (1, 5, 10)
CONDITIONS = ("VEDJE", "frames shuffled at evaluation", "delta head off", "ρ hidden", "T = 1",
              "twin always a training negative")


def motion_tensors(video: str, stage1_backend: str = "attributes", profile_name: str = "demo") -> VedjeTensors:
    """The motion set's frozen inputs under the profile's backbone and that stage-1 expert, computed
    once per video, parameters and models and kept in ``.rde/cache/vedje_motion_<key>/``."""
    import pyarrow.parquet as pq

    from entry.demo_clips import ClipParams
    from entry.motion_clips import VERSION, MotionParams, build_motion_set
    from models.backends.registry import ModelRegistry
    from rde.profile import load_profile
    from rde.vedje.features import build_tables, tensors_from_tables
    from storage import content_key
    from storage.locations import state_dir

    profile = load_profile(profile_name)
    stage1 = next(s for s in profile.models.experts if s.backend == stage1_backend)
    params = MotionParams()
    key = content_key(kind="vedje-motion", version=VERSION, video=video, params=dataclasses.asdict(params),
                      tracking=dataclasses.asdict(ClipParams()), backbone=profile.models.image_embedder.model_dump(),
                      stage1=stage1.model_dump())
    folder = state_dir() / "cache" / f"vedje_motion_{key[:16]}"
    names = ("frames", "items", "queries")
    if not all((folder / f"{n}.parquet").exists() for n in names):
        motion = build_motion_set(video, params)
        print(f"motion set: {len(motion.items.item_ids)} clips (with twins), left out {dict(motion.rejected)}",
              flush=True)
        reg = ModelRegistry.of(profile)
        tables = build_tables(motion.items, reg.image_embedder(), reg.expert(stage1))
        folder.mkdir(parents=True, exist_ok=True)
        for n, t in zip(names, tables, strict=True):
            pq.write_table(t, folder / f"{n}.parquet")
    return tensors_from_tables(*(pq.read_table(folder / f"{n}.parquet") for n in names))


def one_frame(data: VedjeTensors) -> VedjeTensors:
    """T = 1: each clip keeps one frame, the same one for a clip and its twin (the middle of its
    frames in time order), so nothing of the order is left."""
    ordered = torch.sort(data.item_frames, dim=1).values
    middle = ordered.shape[1] // 2
    return dataclasses.replace(data, item_frames=ordered[:, middle:middle + 1].contiguous())


def shuffled(data: VedjeTensors, seed: int) -> VedjeTensors:
    """Each clip's frames in a seeded random order (a fresh permutation per clip)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.stack([torch.randperm(data.item_frames.shape[1], generator=gen) for _ in data.item_frames])
    return dataclasses.replace(data, item_frames=torch.gather(data.item_frames, 1, perm))


def evaluate(model: Any, data: VedjeTensors, n_c: int, zero_rho: bool = False) -> dict[str, np.ndarray]:
    """Per test query: stage-1 and rerank hits at each K (top-``n_c`` reranked, the rest in stage-1
    order), and the pair outcome (1 right, 0.5 tie, 0 wrong) for stage 1 and the reranker on the
    query's clip against its reversed twin (NaN without a twin in the test split)."""
    items = data.items
    twins = twins_of(items.item_ids)
    item_rows, query_rows = data.rows("test")
    in_test = set(item_rows)
    top, sims = stage1_top(data, query_rows, item_rows, len(item_rows))
    n = min(n_c, len(item_rows))
    own = [items.query_items[q] for q in query_rows]
    twin = [twins.get(i, -1) if twins.get(i, -1) in in_test else -1 for i in own]
    needed = sorted({int(i) for i in top[:, :n].ravel()} | set(own) | {t for t in twin if t >= 0})
    where = {i: k for k, i in enumerate(needed)}
    caches = stored_caches(model, data)(needed)
    pairs = [(qi, where[int(i)]) for qi in range(len(query_rows)) for i in top[qi, :n]]
    rho = sims[:, :n].reshape(-1).copy()
    texts = [items.query_texts[q] for q in query_rows]
    scores = _scores(model, texts, pairs, caches, rho, zero_rho).reshape(len(query_rows), n)
    groups = items.groups
    truth = [groups[i] for i in own]
    out: dict[str, np.ndarray] = {}
    first = [[groups[int(i)] for i in row] for row in top]
    reranked = [reranked_order(first[qi], scores[qi], n) for qi in range(len(query_rows))]
    for k in KS:
        out[f"stage1@{k}"], out[f"rerank@{k}"] = hits_at(first, truth, k), hits_at(reranked, truth, k)
    q_emb = data.query_emb[query_rows]
    with_twin = [qi for qi, t in enumerate(twin) if t >= 0]
    pair_list = [(qi, where[r]) for qi in with_twin for r in (own[qi], twin[qi])]
    # in float64 on fresh copies: a float32 dot product's rounding depends on where a row sits in
    # memory, so a clip and its twin (the very same vector) could differ in the last bit and
    # stage 1 would look right or wrong on a pair it cannot tell apart
    item_emb = data.item_emb.double().numpy()
    pair_rho = np.array([float(np.dot(q_emb[qi].double().numpy(), item_emb[r].copy()))
                         for qi in with_twin for r in (own[qi], twin[qi])])
    s = _scores(model, texts, pair_list, caches, pair_rho, zero_rho).reshape(-1, 2)
    s1 = pair_rho.reshape(-1, 2)
    out["pair_rerank"], out["pair_stage1"] = np.full(len(query_rows), np.nan), np.full(len(query_rows), np.nan)
    out["pair_rerank"][with_twin] = np.where(s[:, 0] > s[:, 1], 1.0, np.where(s[:, 0] == s[:, 1], 0.5, 0.0))
    out["pair_stage1"][with_twin] = np.where(s1[:, 0] > s1[:, 1], 1.0, np.where(s1[:, 0] == s1[:, 1], 0.5, 0.0))
    return out


def _scores(model: Any, texts: list[str], pairs: list[tuple[int, int]], caches: torch.Tensor, rho: np.ndarray,
            zero_rho: bool) -> np.ndarray:
    r = torch.from_numpy(np.zeros_like(rho) if zero_rho else rho).float()
    return joint_scores(model, texts, pairs, caches, r, path="fast")


def model_spec(args: argparse.Namespace) -> Any:
    """The profile's vedje section, with ``--encoder`` as the joint encoder when given."""
    from rde.profile import load_profile

    spec = load_profile(args.profile).vedje
    if args.encoder:
        spec = spec.model_copy(update={"joint_encoder": spec.joint_encoder.model_copy(
            update={"model_id": args.encoder, "revision": None})})
    return spec


def new_model(data: VedjeTensors, spec: Any, layers: int | None, seed: int, **shape: Any) -> Any:
    """The untrained model ``train`` starts from: ``spec``'s shape for these inputs, seeded."""
    torch.manual_seed(seed)
    return build_model(spec, data.frame_features.shape[2], data.frame_features.shape[1], data.item_frames.shape[1],
                       data.item_emb.shape[1], layers=layers, **shape)


def train(data: VedjeTensors, args: argparse.Namespace, seed: int, hide_prior: bool = False,
          **shape: Any) -> tuple[Any, float]:
    """A model trained on the motion set's train split with the profile's settings (epochs, depth of
    the training negatives and, for smoke runs, batch and candidates from ``args``); (model, seconds)."""
    spec = model_spec(args)
    if getattr(args, "encoder_dropout", None) is not None:
        shape = {"encoder_dropout": args.encoder_dropout, **shape}
    model = new_model(data, spec, args.layers, seed, **shape)
    sizes = {k: v for k, v in (("batch_size", args.batch), ("train_candidates", args.candidates)) if v}
    cfg = train_config(spec, epochs=args.epochs, negatives_from=args.negatives_from, seed=seed, hide_prior=hide_prior,
                       **sizes)
    result = train_vedje(model, data, cfg)
    return model, result.seconds


@contextlib.contextmanager
def twin_negatives(data: VedjeTensors) -> Iterator[None]:
    """An experiment-only control: while active, each training query's VTM candidates hold its
    clip's reversed twin (in place of one stage-1 negative), so every step's loss rewards reading
    the frame order. The recipe draws its negatives from the stage-1 top ``negatives_from`` only,
    where the twin is one of about 19."""
    import rde.vedje.training as training

    twins = twins_of(data.items.item_ids)
    drawn_by_recipe = training.negatives_for

    def with_twin(query: int, ranked: np.ndarray, groups: Sequence[str], group: str, k: int, seed: int,
                  step: int) -> list[int]:
        drawn = drawn_by_recipe(query, ranked, groups, group, k, seed, step)
        twin = twins.get(data.items.query_items[query])
        if twin is None or k < 1:
            return drawn
        return [twin, *(i for i in drawn if i != twin)][:k]

    training.negatives_for = with_twin
    try:
        yield
    finally:
        training.negatives_for = drawn_by_recipe


def bootstrap(values: np.ndarray, seed: int = 0, draws: int = 2000) -> tuple[float, float]:
    """95 % percentile interval of the mean of ``values`` (one per query) over resampled queries."""
    v = values[~np.isnan(values)]
    if not len(v):
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), size=(draws, len(v)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def summarise(runs: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """Mean ± sd over seeds of each metric (percent), and bootstrap intervals (seed-averaged per query)."""
    out: dict[str, Any] = {}
    for key in runs[0]:
        per_seed = [100 * float(np.nanmean(r[key])) for r in runs]
        out[key] = (float(np.mean(per_seed)), float(np.std(per_seed)))
    gain = np.mean([r["rerank@1"] - r["stage1@1"] for r in runs], axis=0)
    out["gain@1_ci"] = tuple(100 * x for x in bootstrap(gain))
    out["pair_rerank_ci"] = tuple(100 * x for x in bootstrap(np.mean([r["pair_rerank"] for r in runs], axis=0)))
    return out


def probe_accuracy(train_x: np.ndarray, train_y: Sequence[str], test_x: np.ndarray, test_y: Sequence[str]) -> float:
    """Test accuracy (percent) of a logistic-regression probe on standardised features."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, C=0.1))
    probe.fit(train_x, list(train_y))
    return 100.0 * float(np.mean(probe.predict(test_x) == np.asarray(test_y)))


PROBE_VIEWS = ("frames in order", "last − first frame", "frames averaged")


def probe_views(per_frame: torch.Tensor) -> dict[str, torch.Tensor]:
    """Three views of per-frame features (items × T × f): all frames in order (T·f), the last frame
    less the first (f: what changed, with its sign) and the frame average (f: order removed, so a
    clip and its twin look the same and a probe is right on at most half of the twin pairs)."""
    return {"frames in order": per_frame.reshape(len(per_frame), -1),
            "last − first frame": per_frame[:, -1] - per_frame[:, 0], "frames averaged": per_frame.mean(1)}


def probes(model: Any, data: VedjeTensors) -> dict[str, float]:
    """Linear probes for the direction (4 classes; trained on the train clips, accuracy on the test
    clips) on the frozen backbone and on the trained caches, each in ``probe_views``. The backbone's
    per-frame feature is its per-patch energy (the L2 norm of each patch's features, P values: where
    in the crop something is, which a patch average would lose); the cache's is each frame's M
    tokens averaged (d values)."""
    directions = directions_of(data.items.groups)
    tr, _ = data.rows("train")
    te, _ = data.rows("test")
    caches = stored_caches(model, data)
    m = model.shape.tokens_per_frame

    def backbone(rows: list[int]) -> torch.Tensor:
        return data.features(torch.tensor(rows)).norm(dim=-1)  # items × T × P

    def cache(rows: list[int]) -> torch.Tensor:
        z = caches(rows)
        return z.reshape(len(rows), -1, m, z.shape[-1]).mean(2)  # items × T × d

    out = {}
    for source, per_frame in (("backbone", backbone), ("cache Z", cache)):
        train_views, test_views = probe_views(per_frame(tr)), probe_views(per_frame(te))
        for view in PROBE_VIEWS:
            out[f"{source}, {view}"] = probe_accuracy(train_views[view].numpy(), [directions[i] for i in tr],
                                                      test_views[view].numpy(), [directions[i] for i in te])
    return out


def response(model: Any, data: VedjeTensors, n: int = 16) -> dict[str, float]:
    """``vedje_cache_collapse.joint_response`` on a grid of test queries × their clips: the [CLS]'s
    attention on the cache (last layer, and if spread evenly) and the query / clip / interaction
    shares of the scores with ρ = 0 (does the joint encoder read the cache, and jointly?)."""
    from vedje_cache_collapse import joint_response

    view = dataclasses.replace(data, items=dataclasses.replace(
        data.items, splits=["val" if s == "test" else s for s in data.items.splits]))
    r = joint_response(model, view, n)
    return {k: round(float(r[k]), 2) for k in ("attn_cache_last", "attn_uniform", "s_query", "s_item", "s_inter")
            if k in r}


def save_report(report: dict[str, Any], name: str) -> Path:
    """``report`` as JSON in ``.rde/experiments/<name>.json``; its path."""
    from storage.locations import state_dir

    out = state_dir() / "experiments" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    return out


def fmt(pair: tuple[float, float]) -> str:
    return f"{pair[0]:.1f} ± {max(pair[1], 0.1):.1f}"


def table(name: str, s: dict[str, Any]) -> str:
    ci, pci = s["gain@1_ci"], s["pair_rerank_ci"]
    return (f"| {name} | {fmt(s['stage1@1'])} | " + " | ".join(fmt(s[f'rerank@{k}']) for k in KS)
            + f" | {ci[0]:+.1f} … {ci[1]:+.1f} | {fmt(s['pair_stage1'])} | {fmt(s['pair_rerank'])} "
            f"({pci[0]:.1f} … {pci[1]:.1f}) |")


HEADER = ("| condition | stage 1 R@1 | rerank R@1 | R@5 | R@10 | R@1 gain, 95 % CI | pairs, stage 1 | "
          "pairs, rerank (95 % CI) |\n|---|---|---|---|---|---|---|---|")


def run_all(data: VedjeTensors, args: argparse.Namespace) -> dict[str, Any]:
    """Every condition over ``args.seeds`` seeds; per-condition per-seed query results and summaries."""
    results: dict[str, list[dict[str, np.ndarray]]] = {c: [] for c in CONDITIONS}
    report: dict[str, Any] = {"seconds": {}, "probes": []}
    single = one_frame(data)
    for seed in range(args.seeds):
        model, sec = train(data, args, seed)
        report["seconds"].setdefault("VEDJE", []).append(round(sec, 1))
        results["VEDJE"].append(evaluate(model, data, args.n_c))
        results["frames shuffled at evaluation"].append(evaluate(model, shuffled(data, 1000 + seed), args.n_c))
        report["probes"].append(probes(model, data))
        report.setdefault("response", []).append(response(model, data))
        for name, kwargs, on in (("delta head off", {"delta": False}, data), ("ρ hidden", {"hide_prior": True}, data),
                                 ("T = 1", {}, single)):
            hide = kwargs.pop("hide_prior", False)
            model, sec = train(on, args, seed, hide_prior=hide, **kwargs)
            report["seconds"].setdefault(name, []).append(round(sec, 1))
            results[name].append(evaluate(model, on, args.n_c, zero_rho=hide))
        with twin_negatives(data):
            model, sec = train(data, args, seed)
        report["seconds"].setdefault("twin always a training negative", []).append(round(sec, 1))
        results["twin always a training negative"].append(evaluate(model, data, args.n_c))
        print(f"seed {seed} done: {report['seconds']}", flush=True)
    report["summary"] = {c: summarise(results[c]) for c in CONDITIONS}
    report["raw"] = {c: [{k: v.tolist() for k, v in r.items()} for r in results[c]] for c in CONDITIONS}
    return report


def describe(data: VedjeTensors) -> str:
    items = data.items
    tr, qtr = data.rows("train")
    te, qte = data.rows("test")
    tracks = {split: len({g.split(":")[0] for g, s in zip(items.groups, items.splits, strict=True) if s == split})
              for split in ("train", "test")}
    twins = twins_of(items.item_ids)
    same = sum(torch.equal(data.item_emb[a], data.item_emb[b]) for a, b in twins.items() if a < b)
    return (f"{len(items.item_ids)} clips ({len(twins) // 2} with a reversed twin, {same} of them with the very same "
            f"stage-1 embedding), T = {data.item_frames.shape[1]}; train "
            f"{len(tr)} clips of {tracks['train']} track(s), {len(qtr)} queries; test {len(te)} clips of "
            f"{tracks['test']} track(s), {len(qte)} queries")


Loader = Callable[[argparse.Namespace], VedjeTensors]


def load_motion(args: argparse.Namespace) -> VedjeTensors:
    return motion_tensors(args.video, args.stage1, args.profile)


def main(argv: Sequence[str] | None = None, load: Loader = load_motion) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--video", default=VIDEO)
    parser.add_argument("--profile", default="demo")
    parser.add_argument("--stage1", default="attributes", help="the stage-1 expert's backend")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--negatives-from", type=int, default=20, help="stage-1 depth of training negatives")
    parser.add_argument("--n-c", type=int, default=20)
    parser.add_argument("--batch", type=int, default=None, help="queries per step (default: the profile's)")
    parser.add_argument("--candidates", type=int, default=None, help="VTM candidates (default: the profile's)")
    parser.add_argument("--encoder", default=None, help="joint encoder id or folder (default: the profile's)")
    parser.add_argument("--encoder-dropout", type=float, default=None,
                        help="the joint encoder's dropout in training (default: the profile's vedje.encoder_dropout)")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)

    start = time.perf_counter()
    data = load(args)
    print(describe(data), flush=True)
    report = run_all(data, args)
    report["args"] = vars(args)
    print(f"\n{HEADER}")
    for c in CONDITIONS:
        print(table(c, report["summary"][c]))
    print("\n| direction probe (4 classes, test clips) | accuracy % |\n|---|---|")
    for name in report["probes"][0]:
        vals = [p[name] for p in report["probes"]]
        print(f"| {name} | {np.mean(vals):.1f} ± {max(float(np.std(vals)), 0.1):.1f} |")
    if report["response"][0]:
        print("\n| joint encoder on test queries × their clips | mean over seeds |\n|---|---|")
        for key, label in (("attn_cache_last", "[CLS] attention on the cache, last layer (%)"),
                           ("attn_uniform", "the same if spread evenly (%)"),
                           ("s_query", "score (ρ = 0) share: query (%)"), ("s_item", "score share: clip (%)"),
                           ("s_inter", "score share: query × clip interaction (%)")):
            print(f"| {label} | {np.mean([r[key] for r in report['response']]):.1f} |")
    out = save_report(report, "vedje_motion")
    print(f"\n{time.perf_counter() - start:.0f} s; raw results in {out}")
    return report


if __name__ == "__main__":
    main()
