"""Batch size of the embedding stages: the old fixed batch 16 against ``batch_size: auto``, one run.

What is timed is the stages' own model work on real demo-pool crops, called directly (no flow,
no Parquet I/O, no embedding cache):

* ``cgds-embed``: ``ImageEmbedder.embed`` (what the CGDS and LargeFine gallery embedding runs on
  cache misses);
* ``training-features``: ``rde.retrieval_features.image_features`` with the profile's views, the
  semantic-bridge expert, the image embedder and the teacher (the last expert);
* ``vedje-features``: ``rde.vedje_features.frame_feature_rows`` (backbone feature maps + stage-1
  expert embeddings).

Arm ``fixed``: the demo profile as it was (embedder and experts at 16, text encoder at 64). Arm
``auto``: the demo profile now (``auto``). The detector is at the profile's number in both. Each
arm runs once untimed (``auto`` measures then; its cost is printed), then the arms alternate ABBA
and the median of each is compared. With ``--formats`` it also compares EfficientNet-Lite0's
forward at the chosen batch in contiguous vs ``channels_last`` memory format (and ``torch.compile``
with ``--compile``), interleaved the same way.

    .venv/bin/python benchmarks/batch_size.py [--images 48] [--repeats 2] [--formats] [--compile]
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from models.backends import auto_batch
from models.backends.registry import ModelRegistry
from rde.image_decoding import decode_rgb
from rde.profiles import ModelsSection, load_profile
from rde.retrieval_features import image_features
from rde.vedje_features import frame_feature_rows
from storage import Artifact

OLD_BATCH = {"image_embedder": 16, "experts": 16, "text_encoder": 64}  # the demo profile before auto


def fixed_models(models: ModelsSection) -> ModelsSection:
    """The models section with the old fixed batch sizes."""
    return models.model_copy(update={
        "image_embedder": models.image_embedder.model_copy(update={"batch_size": OLD_BATCH["image_embedder"]}),
        "text_encoder": models.text_encoder.model_copy(update={"batch_size": OLD_BATCH["text_encoder"]}),
        "experts": [s.model_copy(update={"batch_size": OLD_BATCH["experts"]}) for s in models.experts]})


def stage_work(models: ModelsSection, images: list[np.ndarray], views: int) -> dict[str, Callable[[], object]]:
    """The three stages' model work with these models."""
    reg = ModelRegistry(models)
    embedder, bridge, teacher = reg.image_embedder(), reg.expert(models.experts[0]), reg.expert(models.experts[-1])
    ids = [str(i) for i in range(len(images))]

    def warm_up() -> None:
        """Everything measured or built on first use: the embedder's and the text encoder's batch (the
        bridge embeds the ImageNet class names once), so no timed call pays for it."""
        embedder.embed(images)
        bridge.encode_image(images[:2])

    return {"warm-up": warm_up, "cgds-embed": lambda: embedder.embed(images),
            "training-features": lambda: image_features(images, ids, bridge, embedder, teacher, views=views),
            "vedje-features": lambda: frame_feature_rows(ids, images, embedder, bridge)}


def abba(arms: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each arm, alternating A B B A ... so drifting load hits both alike."""
    names, out = list(arms), {name: [] for name in arms}
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            arms[name]()
            out[name].append(time.perf_counter() - start)
    return out


def stage_comparison(images: list[np.ndarray], repeats: int, views: int | None) -> None:
    profile = load_profile("demo")
    views = views or profile.training.views
    work = {"fixed": stage_work(fixed_models(profile.models), images, views),
            "auto": stage_work(profile.models, images, views)}
    for arm in ("fixed", "auto"):  # auto measures its batch sizes on first use in the process
        start = time.perf_counter()
        work[arm].pop("warm-up")()
        print(f"warm-up {arm}: {time.perf_counter() - start:.1f} s", flush=True)
    print(f"{'stage':20s} {'fixed 16 s':>10s} {'auto s':>8s} {'speed-up':>9s}  (training views: {views})")
    for stage in work["fixed"]:
        times = abba({arm: work[arm][stage] for arm in work}, repeats)
        fixed, auto = statistics.median(times["fixed"]), statistics.median(times["auto"])
        runs = " ".join(f"{a[0]}{t:.1f}" for a in times for t in times[a])
        print(f"{stage:20s} {fixed:10.2f} {auto:8.2f} {fixed / auto:8.2f}x  [{runs}]", flush=True)
    reg = ModelRegistry(profile.models)
    chosen = {name: b.batch.last["batch_size"] for name, b in
              (("image_embedder", reg.image_embedder()), ("text_encoder", reg.text_encoder())) if b.batch.last}
    print(f"auto chose: {chosen}")


def format_comparison(images: list[np.ndarray], repeats: int, with_compile: bool) -> None:
    """EfficientNet-Lite0 forward at the auto batch: contiguous vs channels_last (vs compiled)."""
    reg = ModelRegistry(load_profile("demo").models)
    emb = reg.image_embedder()
    batch = emb.batch.resolve("image", images, lambda b: emb._features(list(b)))
    x = emb._tensor(images[:batch])
    plain = emb.model
    last = copy.deepcopy(plain).to(memory_format=torch.channels_last)
    x_last = x.contiguous(memory_format=torch.channels_last)
    n = len(images) // batch

    def run(model: torch.nn.Module, t: torch.Tensor) -> Callable[[], object]:
        def call() -> None:
            with torch.inference_mode():
                for _ in range(n):
                    model.extract_features(t)
        return call

    arms = {"contiguous": run(plain, x), "channels_last": run(last, x_last)}
    if with_compile:
        compiled = copy.deepcopy(plain)
        compiled.extract_features = torch.compile(compiled.extract_features)
        start = time.perf_counter()
        run(compiled, x)()
        print(f"torch.compile: first call {time.perf_counter() - start:.1f} s")
        arms["compiled"] = run(compiled, x)
    for arm in arms.values():
        arm()  # warm-up
    times = abba(arms, repeats)
    base = statistics.median(times["contiguous"])
    for name, t in times.items():
        print(f"  {name:14s} batch {batch}: {n * batch / statistics.median(t):7.1f} img/s  "
              f"{base / statistics.median(t):5.2f}x of contiguous")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per arm (ABBA)")
    parser.add_argument("--formats", action="store_true", help="also channels_last (and --compile)")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--views", type=int, default=None, help="training views (default: the profile's)")
    parser.add_argument("--skip-stages", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger().handlers[0].addFilter(lambda r: r.name == auto_batch.__name__)
    rows = [r for r in Artifact("data/demo_pool").read_shard(0).to_pylist() if r["variant"] == "crop"]
    images = [decode_rgb(r["image_bytes"]) for r in rows[: args.images]]
    print(f"{len(images)} demo-pool crops, torch threads {torch.get_num_threads()}")
    if not args.skip_stages:
        stage_comparison(images, args.repeats, args.views)
    if args.formats or args.compile:
        format_comparison(images, max(2, args.repeats * 2), args.compile)


if __name__ == "__main__":
    main()
