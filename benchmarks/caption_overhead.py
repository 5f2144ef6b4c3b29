"""Caption-stage overhead: the GTR+ tier logic against the bare generator, side by side in one run.

"Ours" runs the three tiers over real demo person crops (request building, Q&A parsing, quality
gates, rows) through the demo profile's generator. "Bare" replays exactly the generator requests
ours made, in the same batches, straight into the same generator object: the work a hand-written
loop would do. The grounded captioner is deterministic at temperature 0, so both do the same model
work. Runs alternate in ABBA order after a warm-up; medians are compared.
Target: overhead ratio (ours / bare) ≤ 1.1.

From the measured per-image cost it projects the wall time of 1.2M images (LargeFine-Person) for
one worker like this machine, and for a GPU worker at a token rate you give (``--gpu-tokens-per-s``,
an assumption, not a measurement: no GPU here).

    .venv/bin/python benchmarks/caption_overhead.py [--images 12] [--repeats 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from models.backends.interfaces import GenerationRequest, GenerationResult, Generator
from models.backends.registry import ModelRegistry
from models.prompt_files import load_prompt
from rde.common.image_decoding import decode_rgb
from rde.largefine.hard_negatives import hard_negative_neighbours
from rde.largefine.template_gallery import GalleryBuilder
from rde.largefine.tiered_captions import TierCaptioner, TierImage, TierOutputs
from rde.profile import load_profile
from storage import Artifact

N_LARGEFINE = 1_200_000


@dataclass
class Recorder:
    """Passes calls through to ``inner`` and remembers each batch of requests."""

    inner: Generator
    batches: list[list[GenerationRequest]] = field(default_factory=list)

    @property
    def model_id(self) -> str:
        return self.inner.model_id

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        self.batches.append(list(requests))
        return self.inner.generate(requests)


def person_items(n: int, profile_name: str = "demo") -> list[TierImage]:
    """``n`` demo person crops that pass denoise-like checks (taken from the pool's crop variant),
    each with a hard negative among them."""
    pool = Artifact("data/demo_pool").read_shard(0, ["pool_id", "domain", "variant", "image_bytes"]).to_pylist()
    crops = [r for r in pool if r["variant"] == "crop" and r["domain"] == "pedestrian"]
    crops = [crops[i] for i in np.linspace(0, len(crops) - 1, n).astype(int)]
    images = [decode_rgb(r["image_bytes"]) for r in crops]
    registry = ModelRegistry.of(load_profile(profile_name))
    ids = [r["pool_id"] for r in crops]
    found = hard_negative_neighbours(registry.image_embedder().embed(images), ids, k=10, seed=0)
    index = {i: k for k, i in enumerate(ids)}
    return [TierImage(r["pool_id"], r["pool_id"], "pedestrian", im, 0, nb.hard_negative_id,
                      images[index[nb.hard_negative_id]]) for r, im, nb in zip(crops, images, found, strict=True)]


def run_ours(captioner: TierCaptioner, items: list[TierImage], gallery) -> TierOutputs:
    out = TierOutputs()
    base = captioner.qa_tier(items, "base", out)
    inter = captioner.qa_tier(items, "inter", out)
    captioner.advanced_tier(items, base, inter, gallery, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--gpu-tokens-per-s", type=float, default=2000.0,
                        help="assumed generation throughput of one GPU worker (for the projection only)")
    args = parser.parse_args()
    profile = load_profile("demo")
    generator = ModelRegistry.of(profile).generators()[0]
    recorder = Recorder(generator)
    spec = profile.largefine
    captioner = TierCaptioner([recorder], load_prompt(spec.tier_prompt), spec)
    seeds = load_prompt("gtr_template_gallery")
    builder = GalleryBuilder(seeds.extras["slots"], 1, 100, 100)
    for text in seeds.extras["seeds"]:
        builder.add(text, "seed", 0)
    items = person_items(args.images)

    run_ours(captioner, items, builder.gallery)  # warm-up (models loaded, facts memoised)
    recorded = list(recorder.batches)
    t_ours, t_bare, t_inside, outputs = [], [], [], None

    def ours_once() -> None:
        nonlocal outputs
        start = time.perf_counter()
        outputs = run_ours(captioner, items, builder.gallery)
        t_ours.append(time.perf_counter() - start)
        t_inside.append(outputs.generator_seconds)

    def bare_once() -> None:
        start = time.perf_counter()
        for batch in recorded:
            generator.generate(batch)
        t_bare.append(time.perf_counter() - start)

    for i in range(args.repeats):  # ABBA order, so a drift or an order effect does not favour one side
        for fn in ((ours_once, bare_once) if i % 2 == 0 else (bare_once, ours_once)):
            fn()
    assert outputs is not None
    ours, bare = statistics.median(t_ours), statistics.median(t_bare)
    tokens = outputs.generated_tokens
    calls = sum(len(b) for b in recorded)
    print(f"{len(items)} person crops, generator {generator.model_id}, prompt {spec.tier_prompt}; "
          f"{calls} generator requests per run, {tokens} generated tokens, "
          f"{len(outputs.captions)} captions kept / {len(outputs.rejects)} rejected")
    print("\n| | seconds (median) | images/s | tokens/s |\n|---|---|---|---|")
    for name, t in (("caption stage (ours)", ours), ("bare generator (same requests)", bare)):
        print(f"| {name} | {t:.2f} | {len(items) / t:.3f} | {tokens / t:.1f} |")
    print(f"\noverhead ratio ours / bare: {ours / bare:.3f} (target <= 1.1); of ours, "
          f"{statistics.median(t_inside):.2f} s were inside generator calls, "
          f"{ours - statistics.median(t_inside):.3f} s in the tier logic")
    per_image = ours / len(items)
    tokens_per_image = tokens / len(items)
    print(f"\nprojection for {N_LARGEFINE:,} images (three tiers each):")
    print(f"- one worker like this CPU machine: {per_image:.2f} s/image -> "
          f"{per_image * N_LARGEFINE / 86400:.1f} days")
    gpu_s = tokens_per_image / args.gpu_tokens_per_s
    print(f"- one GPU worker at an assumed {args.gpu_tokens_per_s:.0f} generated tokens/s (not measured): "
          f"{tokens_per_image:.0f} tokens/image -> {gpu_s * N_LARGEFINE / 3600:.1f} h "
          f"(the paper's 7-8B MLLMs write longer texts: scale by their tokens/image)")


if __name__ == "__main__":
    main()
