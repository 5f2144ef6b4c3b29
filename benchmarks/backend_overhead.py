"""Backend overhead: our wrappers against the bare library calls, side by side in one run.

For EfficientNet-Lite0 (embedder) and SSD-MobileNet (detector): images/s at batch sizes 1, 8, 32
on real demo-pool crops; for SmolLM2 through llama.cpp: tokens/s. The bare call does the same
work a user would write by hand (same preprocessing), without our classes. Runs alternate
(ours, bare, ours, bare, ...) and the median of each is compared, because this machine is noisy.
Target: overhead ratio (ours time / bare time) ≤ 1.1. Then the batch-size curve: images/s by batch
from the rows above, and what ``batch_size: auto`` measures and picks on the same images (measured
afresh: its cache goes to a temporary file).

    .venv/bin/python benchmarks/backend_overhead.py [--images 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np
import torch

from models.backends import auto_batch
from models.backends.disk_memo import keep_nothing_on_disk
from models.backends.interfaces import ChatMessage, GenerationRequest
from models.backends.registry import ModelRegistry
from models.specs import ModelSpec
from rde.common.image_decoding import decode_rgb
from rde.profile import load_profile
from storage import Artifact

# the wrapper with the network as the bare call runs it and no reuse of earlier results, so both
# sides do the same work (folding, channels-last and reuse are measured in benchmarks/batch_size.py)
PLAIN = {"fold_batch_norm": False, "channels_last": False, "memo_items": 0}


def interleaved(ours: Callable[[], object], bare: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median seconds of each, measured alternately after one warm-up call of each."""
    ours()
    bare()
    t_ours, t_bare = [], []
    for _ in range(repeats):
        for fn, sink in ((ours, t_ours), (bare, t_bare)):
            start = time.perf_counter()
            fn()
            sink.append(time.perf_counter() - start)
    return statistics.median(t_ours), statistics.median(t_bare)


def bare_effnet(model: torch.nn.Module, images: list[np.ndarray], batch: int) -> np.ndarray:
    out = []
    with torch.inference_mode():
        for i in range(0, len(images), batch):
            x = np.stack([cv2.resize(im, (224, 224)) for im in images[i : i + batch]])
            t = (torch.from_numpy(x).permute(0, 3, 1, 2).float() - 127.0) / 128.0
            f = model.extract_features(t).mean(dim=(2, 3))
            out.append(torch.nn.functional.normalize(f, dim=1).numpy())
    return np.concatenate(out)


def bare_ssd(net: cv2.dnn.Net, images: list[np.ndarray], batch: int) -> list[np.ndarray]:
    out = []
    for i in range(0, len(images), batch):
        net.setInput(cv2.dnn.blobFromImages(images[i : i + batch], size=(300, 300), swapRB=False, crop=False))
        out.append(net.forward())
    return out


def print_batch_curve(results: list[tuple[str, int, float, float]], registry: ModelRegistry,
                      images: list[np.ndarray]) -> None:
    """Images/s by batch from the overhead rows, then what ``auto`` measures and picks."""
    n = len(images)
    for name in dict.fromkeys(r[0] for r in results):
        curve = ", ".join(f"{b}: {n / ours:.1f}" for r_name, b, ours, _ in results if r_name == name)
        print(f"batch curve {name:28s} img/s by batch  {curve}")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[auto_batch.CACHE_ENV] = str(Path(tmp) / "auto_batch.json")
        auto_batch.forget()
        emb = registry.image_embedder(ModelSpec(backend="efficientnet-lite0", model_id="efficientnet-lite0",
                                                batch_size="auto", options=PLAIN))
        emb.embed(images)
        del os.environ[auto_batch.CACHE_ENV]
    last = emb.batch.last or {}
    curve = ", ".join(f"{b}: {v:.1f}" for b, v in last.get("curve", {}).items())
    print(f"auto (efficientnet-lite0 embed) measured img/s by batch  {curve}  -> picks batch {last.get('batch_size')}")


def main() -> None:
    keep_nothing_on_disk()  # time the detector, not detections an earlier run kept
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = [r for r in Artifact("data/demo_pool").read_shard(0).to_pylist() if r["variant"] == "crop"]
    images = [decode_rgb(r["image_bytes"]) for r in rows[: args.images]]
    registry = ModelRegistry.of(load_profile("demo"))
    results: list[tuple[str, int, float, float]] = []

    for batch in (1, 8, 32):
        emb = registry.image_embedder(ModelSpec(backend="efficientnet-lite0", model_id="efficientnet-lite0",
                                                batch_size=batch, options=PLAIN))
        ours, bare = interleaved(lambda emb=emb: emb.embed(images),
                                 lambda emb=emb, b=batch: bare_effnet(emb.model, images, b), args.repeats)
        results.append(("efficientnet-lite0 embed", batch, ours, bare))

    from models.backends.detectors import SsdMobileNetDetector, bundled_ssd_files
    from models.specs import DetectorSpec

    graph, config = bundled_ssd_files()
    raw_net = cv2.dnn.readNetFromTensorflow(str(graph), str(config))
    for batch in (1, 8, 32):
        det = SsdMobileNetDetector(DetectorSpec(batch_size=batch, memo_items=0))

        def ours_det(det=det, b=batch) -> None:
            for i in range(0, len(images), b):
                det.detect(images[i : i + b])

        ours, bare = interleaved(ours_det, lambda b=batch: bare_ssd(raw_net, images, b), args.repeats)
        results.append(("ssd-mobilenet detect", batch, ours, bare))

    print(f"{'backend':28s} {'batch':>5s} {'ours img/s':>11s} {'bare img/s':>11s} {'overhead':>9s}")
    for name, batch, ours, bare in results:
        print(f"{name:28s} {batch:5d} {len(images) / ours:11.1f} {len(images) / bare:11.1f} {ours / bare:8.3f}x")

    print_batch_curve(results, registry, images)

    gen = registry.generator(ModelSpec(backend="llama-cpp", model_id="bundled:SmolLM2-135M-Instruct"))
    prompts = [f"Describe a person wearing a {c} jacket in one sentence." for c in
               ("red", "blue", "black", "green", "white", "gray")][: args.prompts]
    requests = [GenerationRequest(str(i), [ChatMessage("user", p)], max_tokens=48) for i, p in enumerate(prompts)]
    counted = {"ours": 0, "bare": 0}

    def ours_gen() -> None:
        counted["ours"] = sum(len(r.tokens) for r in gen.generate(requests))

    def bare_gen() -> None:
        total = 0
        for p in prompts:
            with gen.context() as server:
                r = server.handle_chat_completions({"messages": [{"role": "user", "content": p}], "max_tokens": 48,
                                                    "temperature": 0.0, "logprobs": True, "top_logprobs": 1})
            total += len(r["choices"][0]["logprobs"]["content"])
        counted["bare"] = total

    ours, bare = interleaved(ours_gen, bare_gen, max(2, args.repeats // 2))
    ours_rate, bare_rate = counted["ours"] / ours, counted["bare"] / bare
    print(f"{'smollm2 llama.cpp generate':28s} {'-':>5s} {ours_rate:9.1f}t/s {bare_rate:9.1f}t/s "
          f"{bare_rate / ours_rate:8.3f}x")


if __name__ == "__main__":
    main()
