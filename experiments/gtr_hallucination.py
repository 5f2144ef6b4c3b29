"""Controlled measurement: does GTR+ confidence weighting find hallucination-style caption noise?

Noise: a share of the training captions gets one or two grounded facts replaced by
wrong ones of the same kind (a colour, a garment, a carried object, a direction;
``rde/training/caption_noise.py``), the sentence kept fluent. Each caption has one fixed
corrupted version (drawn with a seed per caption); a seed chooses which captions are corrupted
(nested: the 10 % are among the 30 %, those among the 50 %) and the training seed.

q_txt (Eq. 8) of every training caption, clean and corrupted, is recomputed by teacher forcing
(``GroundedCaptionGenerator.score``: the mean token probability of the given text as the reply
of the same generator, SmolLM2-135M through llama.cpp, under the same image facts in the system
prompt), so clean and corrupted captions are on one scale and q_txt falls where the generator
would not have said the text. The request each tier's caption answered is rebuilt from the run:

* base: ``base_sum`` of the tier prompt with the image's stored base Q&A answers (``qa_pairs``,
  in ``pair_index`` order), the image attached (its facts go into the system prompt);
* inter: ``inter_sum`` with the stored inter answers, the image and its hard negative attached
  (target and reference facts, as generated);
* adv: ``adv`` with the drawn template (``template_id`` in the run's ``template_gallery``) and the
  image's accepted T_base and T_inter texts (what the advanced tier was given), the image attached.

The forced text is the exported ``text`` (after the quality gates' cleaning), not the raw output,
and the grounding filter does not run on it, so a clean caption's teacher-forced q_txt differs
from its generation-time q_txt (computed over the kept tokens of the raw output); the script
prints their correlation as a check. Scores are cached on disk (``--cache``, default under the
state folder) by request and text, so a rerun redoes none of them.

Training and evaluation as in ``gtr_noise.py`` (its helpers): ITC + ITM on the cached features,
no weighting vs FixWeight (w = q_txt) vs AdaWeight (GMM on ŝ = γ·s + (1 − γ)·q_txt each epoch,
C^β), the same identity split; R@1/5/10, mAP, mINP on the held-out identities; for AdaWeight the
last GMM's noise detection (C < 0.5 = flagged) against the injected corruptions. The corrupted
captions' text features are re-encoded with the same text tower.

    .venv/bin/python experiments/gtr_hallucination.py --output /tmp/lf240 [--epochs 6] [--seeds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from gtr_noise import Split, evaluate, load_run, mean_sd, train_and_evaluate
from saft_ablation import feature_cache, model_dims

from models.backends.interfaces import ChatMessage, GenerationRequest, GenerationResult
from models.retrieval.dual_encoder import FeatureDualEncoder
from rde.training.caption_noise import Swap, corrupt_caption

RATES = (0.1, 0.3, 0.5)
WEIGHTINGS = ("none", "fix", "ada")
METRICS = ("R@1", "R@5", "R@10", "mAP", "mINP", "precision", "recall")
Scorer = Callable[[list[GenerationRequest], list[str]], list[GenerationResult]]


def corrupt_all(texts: Sequence[str], seed: int = 17) -> tuple[list[str], list[list[Swap]]]:
    """One corrupted version per caption (an rng per caption index, so it does not depend on
    which other captions there are); captions without a known-kind word keep their text, no swaps."""
    out, swaps = [], []
    for i, text in enumerate(texts):
        new, s = corrupt_caption(text, np.random.default_rng([seed, i]))
        out.append(new)
        swaps.append(s)
    return out, swaps


def _key(request: GenerationRequest, text: str, model_id: str) -> str:
    user = "\n".join(f"{m.role}:{m.content}" for m in request.messages)
    # v2: without the end-of-turn token (GroundedCaptionGenerator.score)
    return hashlib.sha256(f"v2\n{model_id}\n{request.request_id}\n{user}\n\0{text}".encode()).hexdigest()[:24]


def teacher_forced_q(score: Scorer, model_id: str, requests: Sequence[GenerationRequest], texts: Sequence[str],
                     cache: Path, save_every: int = 20, log: Callable[[str], None] = print) -> np.ndarray:
    """q_txt (Eq. 8) of each text by teacher forcing under its request; NaN where scoring failed.
    Cached in ``cache`` (JSON, key → q) and saved every ``save_every`` new scores."""
    known: dict[str, float | None] = json.loads(cache.read_text()) if cache.exists() else {}
    keys = [_key(r, t, model_id) for r, t in zip(requests, texts, strict=True)]
    todo = [i for i, k in enumerate(keys) if k not in known]
    start, failed = time.perf_counter(), 0
    for n, i in enumerate(todo, 1):
        [res] = score([requests[i]], [texts[i]])
        known[keys[i]] = res.mean_token_probability if res.ok else None
        failed += not res.ok
        if n % save_every == 0 or n == len(todo):
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(known))
            log(f"  teacher forcing: {n}/{len(todo)} scored ({failed} failed), {time.perf_counter() - start:.0f}s")
    return np.array([np.nan if known[k] is None else known[k] for k in keys], np.float64)


def tier_requests(root: str, caps: list[dict]) -> tuple[list[GenerationRequest], object, np.ndarray, np.ndarray]:
    """The request each training caption answered, rebuilt from the run (see the module doc),
    the demo profile's generator that wrote them, and per caption whether the quality gates left
    the generator's text unchanged (``text == raw_text``), and each caption's tier. ``caps``:
    ``training_captions`` rows with ``row`` (their index there), which is also their row among the
    run's non-check-set captions."""
    from models.backends.registry import ModelRegistry
    from models.prompt_files import load_prompt
    from rde.common.expert_check import held_out_identities, load_check_yaml
    from rde.common.image_decoding import decode_rgb
    from rde.largefine.qa_pairs import QAPair, format_qa_pairs
    from rde.largefine.template_gallery import load_gallery
    from rde.largefine.tiered_captions import TierCaptioner
    from rde.profile import load_profile
    from storage import Artifact

    profile = load_profile("demo")
    prompt = load_prompt(profile.largefine.tier_prompt)
    # the same rows in the same order as training_captions (its filter: no check-set identity)
    held_out = held_out_identities(load_check_yaml())
    ident = {r["image_id"]: r["identity"] for r in Artifact(f"{root}/neighbours").rows(["image_id", "identity"])}
    all_rows = [r for r in Artifact(f"{root}/largefine").rows(
        ["image_id", "domain", "text", "raw_text", "tier", "hard_negative_id", "template_id", "generator", "prompt"])
        if ident[r["image_id"]] not in held_out]
    by_key = {(r["image_id"], r["text"], k): r for k, r in enumerate(all_rows)}
    qa: dict[tuple[str, str], list[tuple[int, QAPair]]] = defaultdict(list)
    for r in Artifact(f"{root}/qa_pairs").rows(["image_id", "tier", "pair_index", "question", "answer"]):
        qa[(r["image_id"], r["tier"])].append((r["pair_index"], QAPair(r["question"], r["answer"])))
    earlier = {(r["image_id"], r["tier"]): r["text"] for r in Artifact(f"{root}/tier12_captions").rows(
        ["image_id", "tier", "text"])}
    gallery = {t.template_id: t.text for t in load_gallery(f"{root}/template_gallery").templates}
    meta = [by_key[(c["image_id"], c["text"], c["row"])] for c in caps]
    wanted = {m["image_id"] for m in meta} | {m["hard_negative_id"] for m in meta if m["tier"] == "inter"}
    images = {}
    for _, table in Artifact(f"{root}/accepted").iter_shards(["image_id", "image_bytes"]):
        for r in table.to_pylist():
            if r["image_id"] in wanted and r["image_id"] not in images:
                images[r["image_id"]] = decode_rgb(r["image_bytes"])
    generator = ModelRegistry.of(profile).generator(profile.models.generators[0])
    # the tier prompt's words for each image's subject, as the run's captioner chose them
    captioner = TierCaptioner([generator], prompt, profile.largefine, profile.domain_set)
    requests = []
    for m in meta:
        image_id, tier = m["image_id"], m["tier"]
        words = captioner.wording(SimpleNamespace(domain=m["domain"]))
        if m["generator"] != generator.model_id:
            raise ValueError(f"{image_id}/{tier} was written by {m['generator']}, not {generator.model_id}")
        if not str(m["prompt"]).startswith(prompt.identity):
            raise ValueError(f"{image_id}/{tier} was written with prompt {m['prompt']!r}, not {prompt.identity}")
        if tier == "adv":
            text = prompt.render("adv", **words, template=gallery[m["template_id"]], base=earlier[(image_id, "base")],
                                 inter=earlier[(image_id, "inter")])
            attached = [images[image_id]]
        else:
            pairs = [p for _, p in sorted(qa[(image_id, tier)], key=lambda x: x[0])]
            text = prompt.render(f"{tier}_sum", **words, qa=format_qa_pairs(pairs),
                                 answers=" ".join(p.answer for p in pairs))
            attached = [images[image_id]] + ([images[m["hard_negative_id"]]] if tier == "inter" else [])
        step = "adv" if tier == "adv" else "sum"
        requests.append(GenerationRequest(f"{image_id}:{tier}:{step}", [ChatMessage("user", text, attached)]))
    unchanged = np.array([m["raw_text"] == m["text"] for m in meta])
    return requests, generator, unchanged, np.array([m["tier"] for m in meta])


def auc(scores_noisy: np.ndarray, scores_clean: np.ndarray) -> float:
    """P(a corrupted caption's q_txt < a clean one's) (ties half): how well q_txt alone separates them."""
    a, b = scores_noisy[~np.isnan(scores_noisy)], scores_clean[~np.isnan(scores_clean)]
    if not len(a) or not len(b):
        return float("nan")
    return float(((a[:, None] < b[None, :]).sum() + 0.5 * (a[:, None] == b[None, :]).sum()) / (len(a) * len(b)))


def corrupted_pairs(corruptible: np.ndarray, rate: float, seed: int) -> np.ndarray:
    """A seed's corrupted pairs (booleans over the training pairs): the first ``rate·n`` of a seeded
    permutation of the corruptible ones, so a higher rate corrupts a superset."""
    order = np.random.default_rng(100 + seed).permutation(np.flatnonzero(corruptible))
    noisy = np.zeros(len(corruptible), bool)
    noisy[order[: min(len(order), round(rate * len(corruptible)))]] = True
    return noisy


def with_noise(f: dict[str, np.ndarray], index: np.ndarray, noisy: np.ndarray, clean_q: np.ndarray,
               noisy_q: np.ndarray, noisy_texts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The training pairs' text features and q_txt with the ``noisy`` ones swapped for their corrupted
    versions."""
    texts = f["texts"][index].copy()
    texts[noisy] = noisy_texts[noisy]
    return texts, np.where(noisy, noisy_q, clean_q).astype(np.float32)


def noise_runs(f: dict[str, np.ndarray], split: Split, index: np.ndarray, clean_q: np.ndarray,
               noisy_q: np.ndarray, noisy_texts: np.ndarray, corruptible: np.ndarray, rates: Sequence[float],
               seeds: int, epochs: int, lr: float, weightings: Sequence[str] = WEIGHTINGS
               ) -> dict[tuple[float, str], list[dict[str, float]]]:
    """Train and evaluate every (noise rate, weighting) over ``seeds`` seeds. ``index``: the training
    pairs (indices into ``f``); ``clean_q``/``noisy_q``/``noisy_texts``/``corruptible`` are aligned with
    it. A seed's corrupted pairs are the first ``rate·len(index)`` of a permutation of the corruptible
    ones. Each row also holds ``auc``: how well q_txt alone separates the corrupted pairs."""
    out: dict[tuple[float, str], list[dict[str, float]]] = defaultdict(list)
    for seed in range(seeds):
        for rate in rates:
            noisy = corrupted_pairs(corruptible, rate, seed)
            texts, q = with_noise(f, index, noisy, clean_q, noisy_q, noisy_texts)
            for weighting in weightings:
                m = train_and_evaluate(f, split, texts, q, noisy, weighting, seed, epochs, lr, pairs_index=index)
                m["auc"] = auc(q[noisy], q[~noisy])
                m["noisy_share"] = float(noisy.mean())
                out[(rate, weighting)].append(m)
    return out


def results_table(results: dict[tuple[float, str], list[dict[str, float]]], zero: dict[str, float] | None) -> str:
    """One markdown table: a row per (noise, weighting), mean ± sd over seeds."""
    lines = ["| noise | weighting | R@1 | R@5 | R@10 | mAP | mINP | noisy found: precision | recall |",
             "|---|---|---|---|---|---|---|---|---|"]
    if zero is not None:
        lines.append("| - | zero-shot | " + " | ".join(f"{zero[k]:.3f}" for k in METRICS[:5]) + " | - | - |")
    for (rate, weighting), rows in sorted(results.items(), key=lambda kv: (kv[0][0], WEIGHTINGS.index(kv[0][1]))):
        lines.append(f"| {rate:.0%} | {weighting} | " + " | ".join(mean_sd(rows, k) for k in METRICS) + " |")
    return "\n".join(lines)


@dataclass
class HallucinationInputs:
    """Everything the runs need, aligned with ``index`` (the training pairs): the clean and corrupted
    teacher-forced q_txt, the corrupted captions' text features, which captions have a fact to
    corrupt, and each caption's tier."""

    f: dict[str, np.ndarray]
    split: Split
    index: np.ndarray
    clean_q: np.ndarray
    noisy_q: np.ndarray
    noisy_texts: np.ndarray
    corruptible: np.ndarray
    tiers: np.ndarray


def parser_with_run_options(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-captions", type=int, default=None, help="train on at most this many captions")
    parser.add_argument("--output", default=None, help="the build-largefine run's --output (default: the profile's)")
    parser.add_argument("--cache", default=None, help="teacher-forced q_txt cache (JSON)")
    return parser


def hallucination_inputs(args: argparse.Namespace) -> HallucinationInputs:
    """Load the run, corrupt its captions, teacher-force q_txt of both versions (cached) and print the
    scoring checks (see the module doc)."""
    root, f, caps, split = load_run(args.output)
    index = split.train_pairs
    if args.max_captions is not None and args.max_captions < len(index):
        index = np.sort(np.random.default_rng(0).choice(index, size=args.max_captions, replace=False))
    cache = Path(args.cache) if args.cache else feature_cache(root).with_name(
        feature_cache(root).stem.replace("saft_features", "teacher_forced_q") + ".json")

    clean = [caps[i]["text"] for i in index]
    corrupted, swaps = corrupt_all([c["text"] for c in caps])
    corrupted, swaps = [corrupted[i] for i in index], [swaps[i] for i in index]
    corruptible = np.array([bool(s) for s in swaps])
    kinds: dict[str, int] = defaultdict(int)
    for s in swaps:
        for w in s:
            kinds[w.kind] += 1
    print(f"train: {len(index)} pairs ({int(corruptible.sum())} with a fact to corrupt; swaps by kind "
          f"{dict(kinds)}); test: {len(split.test_pairs)} caption queries over {len(split.test_images)} images of "
          f"{len(split.test_ids)} identities; {args.epochs} epochs; ITC + ITM")
    for i in np.flatnonzero(corruptible)[:3]:
        print(f"  e.g. {clean[i]!r}\n    → {corrupted[i]!r}")

    requests, generator, unchanged, tiers = tier_requests(root, [{**caps[i], "row": int(i)} for i in index])
    both_req = [r for r, ok in zip(requests, corruptible, strict=True) for r in ([r, r] if ok else [r])]
    both_txt = [t for c, n, ok in zip(clean, corrupted, corruptible, strict=True) for t in ([c, n] if ok else [c])]
    q_all = teacher_forced_q(generator.score, generator.model_id, both_req, both_txt, cache)
    pos = np.cumsum([2 if ok else 1 for ok in corruptible]) - np.where(corruptible, 2, 1)
    clean_q = q_all[pos]
    noisy_q = np.where(corruptible, q_all[np.minimum(pos + 1, len(q_all) - 1)], np.nan)

    gen_q = f["q_txt"][index].astype(np.float64)
    ok = ~np.isnan(gen_q) & ~np.isnan(clean_q)
    pearson = float(np.corrcoef(gen_q[ok], clean_q[ok])[0, 1]) if ok.sum() > 2 else float("nan")
    rank = lambda x: np.argsort(np.argsort(x))  # noqa: E731
    spearman = float(np.corrcoef(rank(gen_q[ok]), rank(clean_q[ok]))[0, 1]) if ok.sum() > 2 else float("nan")
    same = ok & unchanged
    same_r = float(np.corrcoef(gen_q[same], clean_q[same])[0, 1]) if same.sum() > 2 else float("nan")
    print(f"\nclean captions: generation-time q_txt {np.nanmean(gen_q):.3f} vs teacher-forced "
          f"{np.nanmean(clean_q):.3f}; correlation Pearson {pearson:.3f}, Spearman {spearman:.3f} "
          f"(n = {int(ok.sum())}); where the gates left the text unchanged: Pearson {same_r:.3f}, mean |Δ| "
          f"{np.mean(np.abs(gen_q[same] - clean_q[same])):.4f} (n = {int(same.sum())}); "
          f"{int(np.isnan(q_all).sum())} scores failed")
    pair_ok = corruptible & ~np.isnan(clean_q) & ~np.isnan(noisy_q)
    lower = float(np.mean(noisy_q[pair_ok] < clean_q[pair_ok])) if pair_ok.any() else float("nan")
    c, n = clean_q[corruptible], noisy_q[corruptible]
    print(f"teacher-forced q_txt of the corruptible captions: clean {np.nanmean(c):.3f} ± {np.nanstd(c):.3f}, "
          f"corrupted {np.nanmean(n):.3f} ± {np.nanstd(n):.3f}; corrupted below its clean version in "
          f"{lower:.0%} of {int(pair_ok.sum())}; AUC(q_txt separates corrupted from clean) {auc(n, c):.3f}")
    texts = generator_free_text_features(corrupted, corruptible, f, index)
    return HallucinationInputs(f, split, index, clean_q, noisy_q, texts, corruptible, tiers)


def main() -> None:
    parser = parser_with_run_options(__doc__.splitlines()[0])
    parser.add_argument("--rates", default="0.1,0.3,0.5")
    args = parser.parse_args()
    torch.set_num_threads(2)
    h = hallucination_inputs(args)
    rates = tuple(float(r) for r in args.rates.split(","))
    results = noise_runs(h.f, h.split, h.index, h.clean_q, h.noisy_q, h.noisy_texts, h.corruptible, rates, args.seeds,
                         args.epochs, args.lr)
    zero = evaluate(FeatureDualEncoder(**model_dims(h.f)), h.f, h.split)
    print("\n" + results_table(results, zero))
    print("\n| noise | AUC of q_txt alone (corrupted below clean) |\n|---|---|")
    for rate in rates:
        print(f"| {rate:.0%} | {mean_sd(results[(rate, 'none')], 'auc')} |")


def generator_free_text_features(texts: list[str], corruptible: np.ndarray, f: dict[str, np.ndarray],
                                 index: np.ndarray) -> np.ndarray:
    """Text-tower features of the corrupted captions (the clean ones' where nothing was corrupted)."""
    from models.backends.registry import ModelRegistry
    from rde.profile import load_profile

    profile = load_profile("demo")
    bridge = ModelRegistry.of(profile).expert(profile.models.experts[0])
    out = f["texts"][index].copy()
    rows = np.flatnonzero(corruptible)
    if len(rows):
        out[rows] = bridge.encode_text([texts[i] for i in rows])
    return out


if __name__ == "__main__":
    main()
