"""Speed of the embedding stages: the old fixed batch 16 against ``batch_size: auto`` and the rest, one run.

What is timed is the stages' own model work on real demo-pool crops, called directly (no flow,
no Parquet I/O, no embedding cache):

* ``cgds-embed``: ``ImageEmbedder.embed`` (what the CGDS and LargeFine gallery embedding runs on
  cache misses);
* ``training-features``: ``rde.training.retrieval_features.image_features`` with the profile's views, the
  semantic-bridge expert, the image embedder and the teacher (the last expert);
* ``vedje-features``: ``rde.vedje.features.frame_feature_rows`` (backbone feature maps + stage-1
  expert embeddings).

Three arms, each a models section of the demo profile:

* ``before``: the demo as it was: embedder and experts at batch 16, text encoder at 64, batch norms
  unfolded, no reuse (each backend runs its own forward and detector pass);
* ``batch-only``: ``batch_size: auto``, the rest as before (the effect of the batch size alone);
* ``now``: the demo profile now: ``auto``, batch norms folded into the convs, channels-last
  memory, forwards and detections reused between the backends of a stage
  (``models/backends/content_memo.py``).

The detector runs at the profile's number in all arms. Each arm runs once untimed (``auto``
measures then; its cost is printed), then the arms alternate A B C C B A and the median of each is
compared. Memos are emptied before every timed call: what is timed is one pass of a stage over
images it has not seen. With ``--formats`` it also compares EfficientNet-Lite0's forward at the
chosen batch in three memory layouts: NCHW throughout, as before (the permuted, NHWC-strided input
into NCHW weights) and ``channels_last``; with ``--compile`` also ``torch.compile`` (its first call
is timed apart), interleaved the same way.

    .venv/bin/python benchmarks/batch_size.py [--images 48] [--repeats 2] [--formats] [--compile]
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time
from collections.abc import Callable

import cv2
import numpy as np
import torch

from models.backends import auto_batch, content_memo
from models.backends.disk_memo import keep_nothing_on_disk
from models.backends.registry import ModelRegistry
from models.specs import ModelSpec, ModelsSection
from rde.common.image_decoding import decode_rgb
from rde.profile import load_profile
from rde.training.retrieval_features import image_features
from rde.vedje.features import frame_feature_rows
from storage import Artifact

OLD_BATCH = {"image_embedder": 16, "experts": 16, "text_encoder": 64}  # the demo profile before auto
# EfficientNet-Lite0 as it was: batch norms unfolded, contiguous memory, no reuse between backends
SLOW_PATH = {"fold_batch_norm": False, "channels_last": False, "memo_items": 0}


def arm_models(models: ModelsSection, old_batch: bool, old_code: bool) -> ModelsSection:
    """The models section of one arm: the old fixed batch sizes and/or the old code path (no batch
    norm folding, no reuse of forwards and detections between the backends of a stage)."""
    def spec(s: ModelSpec, role: str) -> ModelSpec:
        update: dict = {"batch_size": OLD_BATCH[role]} if old_batch else {}
        if old_code and role == "image_embedder":  # the bridge's network is this one, with its options
            update["options"] = {**s.options, **SLOW_PATH}
        return s.model_copy(update=update)

    detector = models.detector.model_copy(update={"memo_items": 0}) if old_code else models.detector
    return models.model_copy(update={
        "image_embedder": spec(models.image_embedder, "image_embedder"),
        "text_encoder": spec(models.text_encoder, "text_encoder"),
        "experts": [spec(s, "experts") for s in models.experts], "detector": detector})


ARMS = {"before": (True, True), "batch-only": (False, True), "now": (False, False)}


def stage_work(models: ModelsSection, images: list[np.ndarray], views: int) -> dict[str, Callable[[], object]]:
    """The three stages' model work with these models, each call starting with empty memos (what
    one stage pass over new images costs: the reuse measured is the one within the stage)."""
    reg = ModelRegistry(models)
    embedder, bridge, teacher = reg.image_embedder(), reg.expert(models.experts[0]), reg.expert(models.experts[-1])
    ids = [str(i) for i in range(len(images))]

    def warm_up() -> None:
        """Everything measured or built on first use: the embedder's and the text encoder's batch (the
        bridge embeds the ImageNet class names once), so no timed call pays for it."""
        embedder.embed(images)
        bridge.encode_image(images[:2])

    def fresh(work: Callable[[], object]) -> Callable[[], object]:
        def call() -> object:
            content_memo.clear_all()
            return work()
        return call

    return {"warm-up": warm_up, "cgds-embed": fresh(lambda: embedder.embed(images)),
            "training-features": fresh(lambda: image_features(images, ids, bridge, embedder, teacher, views=views)),
            "vedje-features": fresh(lambda: frame_feature_rows(ids, images, embedder, bridge))}


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
    work = {arm: stage_work(arm_models(profile.models, *flags), images, views) for arm, flags in ARMS.items()}
    for arm in work:  # auto measures its batch sizes on first use in the process
        start = time.perf_counter()
        work[arm].pop("warm-up")()
        print(f"warm-up {arm}: {time.perf_counter() - start:.1f} s", flush=True)
    print(f"{'stage':18s} {'before s':>9s} {'batch-only s':>12s} {'now s':>7s} {'batch-only':>10s} {'now':>6s}"
          f"  (speed-ups against before; training views: {views})")
    for stage in work["before"]:
        times = abba({arm: work[arm][stage] for arm in work}, repeats)
        med = {arm: statistics.median(t) for arm, t in times.items()}
        runs = " ".join(f"{a[0]}{t:.1f}" for a in times for t in times[a])
        print(f"{stage:18s} {med['before']:9.2f} {med['batch-only']:12.2f} {med['now']:7.2f} "
              f"{med['before'] / med['batch-only']:9.2f}x {med['before'] / med['now']:5.2f}x  [{runs}]", flush=True)
    reg = ModelRegistry.of(profile)
    chosen = {name: b.batch.last["batch_size"] for name, b in
              (("image_embedder", reg.image_embedder()), ("text_encoder", reg.text_encoder())) if b.batch.last}
    print(f"auto chose: {chosen}")


def format_comparison(images: list[np.ndarray], repeats: int, with_compile: bool) -> None:
    """EfficientNet-Lite0 forward at the auto batch (batch norms folded, as the profile loads it):
    NCHW vs as before vs channels_last (vs compiled)."""
    reg = ModelRegistry.of(load_profile("demo"))
    emb = reg.image_embedder()
    batch = emb.batch.resolve("image", images, lambda b: emb._features(list(b)))
    plain = copy.deepcopy(emb.model).to(memory_format=torch.contiguous_format)
    x = emb._tensor(images[:batch]).contiguous()  # NCHW throughout
    permuted = torch.from_numpy(np.stack([cv2.resize(im, (224, 224)) for im in images[:batch]])).permute(0, 3, 1, 2)
    x_as_before = (permuted.float() - 127.0) / 128.0  # the old input: NHWC strides, NCHW weights
    last = copy.deepcopy(plain).to(memory_format=torch.channels_last)
    x_last = x.contiguous(memory_format=torch.channels_last)
    n = len(images) // batch

    def run(model: torch.nn.Module, t: torch.Tensor) -> Callable[[], object]:
        def call() -> None:
            with torch.inference_mode():
                for _ in range(n):
                    model.extract_features(t)
        return call

    arms = {"contiguous": run(plain, x), "as-before": run(plain, x_as_before), "channels_last": run(last, x_last)}
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
    keep_nothing_on_disk()  # time the detector, not detections an earlier run kept
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
