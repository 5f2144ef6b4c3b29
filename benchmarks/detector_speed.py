"""Speed of the demo's detector (the measure stage's model work): batch sizes, thread counts, and
where a forward spends its time, one run.

What is timed is ``SsdMobileNetDetector`` (SSD-MobileNet-v2 COCO through OpenCV DNN) on real
demo-pool crops, called directly: no flow, no Parquet, no detection memo (``_detect_all``, which
cuts the images into chunks of ``spec.batch_size``). Arms:

* one per ``--batches`` size, the OpenCV thread count left as it is;
* with ``--threads``, batch 8 with OpenCV on one thread, and two networks on one thread each
  detecting the two halves of the images at once (threads; OpenCV releases the GIL).

The arms alternate (A B C … C B A …) and the median of ``--repeats`` is compared. Every arm's
detections (boxes, labels, scores) are compared with batch 8's, exactly ("same": the bits, which
hold on this machine's kernels, not by construction) and within half a pixel and 1e-4 of score
("close": what must hold on any CPU): speed options must not change what the measure stage records.
Last, OpenCV's per-layer profile of one batch-8 forward, summed by kind: the class-prediction heads
(91 COCO classes) against the rest.

    .venv/bin/python benchmarks/detector_speed.py [--images 128] [--repeats 3] [--threads]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import cv2
import numpy as np

from models.backends.detectors import Detections, SsdMobileNetDetector
from rde.common.image_decoding import decode_rgb
from rde.profile import load_profile
from storage import Artifact

ROOT = Path(__file__).resolve().parents[1]


def demo_images(n: int) -> list[np.ndarray]:
    """The first ``n`` demo-pool images, decoded as the measure stage decodes them."""
    table = Artifact(str(ROOT / "data" / "demo_pool")).read_shard(0, ["image_bytes"]).slice(0, n)
    return [decode_rgb(b) for b in table.column("image_bytes").to_pylist()]


def same_detections(a: Sequence[Detections], b: Sequence[Detections]) -> bool:
    """True when two runs found exactly the same boxes, labels and scores in every image."""
    return len(a) == len(b) and all(
        x.labels == y.labels and np.array_equal(x.boxes, y.boxes) and np.array_equal(x.scores, y.scores)
        for x, y in zip(a, b, strict=True))


def close_detections(a: Sequence[Detections], b: Sequence[Detections], box_px: float = 0.5,
                     score: float = 1e-4) -> bool:
    """True when two runs found the same labels in every image, boxes within ``box_px`` pixels and
    scores within ``score``: what must hold on any CPU, where a batch's shape may change a
    convolution's last bits (``same_detections`` says whether it did here)."""
    return len(a) == len(b) and all(
        x.labels == y.labels and x.boxes.shape == y.boxes.shape
        and np.allclose(x.boxes, y.boxes, rtol=0, atol=box_px) and np.allclose(x.scores, y.scores, rtol=0, atol=score)
        for x, y in zip(a, b, strict=True))


def head_share(layer_ms: dict[str, float]) -> float:
    """Share of a forward's time spent in the class-prediction convolutions (``*/ClassPredictor/*``)."""
    total = sum(layer_ms.values())
    heads = sum(ms for name, ms in layer_ms.items() if "ClassPredictor/" in name)
    return heads / total if total else 0.0


def layer_times(detector: SsdMobileNetDetector, images: list[np.ndarray]) -> dict[str, float]:
    """Milliseconds per layer of one forward over ``images`` (OpenCV's own profile)."""
    detector.net.setInput(detector.blob(images))
    detector.net.forward()
    _, per_layer = detector.net.getPerfProfile()
    ticks_per_ms = cv2.getTickFrequency() / 1000.0
    return {name: float(t) / ticks_per_ms
            for name, t in zip(detector.net.getLayerNames(), np.ravel(per_layer), strict=True)}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float | bool]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--threads", action="store_true", help="also one OpenCV thread, and two one-thread nets")
    args = parser.parse_args(argv)

    spec = load_profile("demo").models.detector
    images = demo_images(args.images)
    detector = SsdMobileNetDetector(spec)
    second = SsdMobileNetDetector(spec) if args.threads else None
    threads_before = cv2.getNumThreads()

    def at_batch(size: int) -> Callable[[], list[Detections]]:
        def run() -> list[Detections]:
            detector.spec = spec.model_copy(update={"batch_size": size})
            return detector._detect_all(images)
        return run

    def one_thread() -> list[Detections]:
        cv2.setNumThreads(1)
        try:
            return at_batch(8)()
        finally:
            cv2.setNumThreads(threads_before)

    def two_nets() -> list[Detections]:
        assert second is not None
        half = len(images) // 2
        parts: dict[int, list[Detections]] = {}
        nets = {0: (detector, images[:half]), 1: (second, images[half:])}

        def work(k: int) -> None:
            net, part = nets[k]
            net.spec = spec.model_copy(update={"batch_size": 8})
            parts[k] = net._detect_all(part)

        cv2.setNumThreads(1)
        try:
            workers = [threading.Thread(target=work, args=(k,)) for k in nets]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        finally:
            cv2.setNumThreads(threads_before)
        return parts[0] + parts[1]

    arms: dict[str, Callable[[], list[Detections]]] = {f"batch {b}": at_batch(b) for b in args.batches}
    if args.threads:
        arms["batch 8, one OpenCV thread"] = one_thread
        arms["two nets, one thread each"] = two_nets
    reference = at_batch(8)()  # also the untimed warm-up of the network
    times: dict[str, list[float]] = {name: [] for name in arms}
    same: dict[str, bool] = {}
    close: dict[str, bool] = {}
    order = list(arms)
    for r in range(args.repeats):
        for name in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            found = arms[name]()
            times[name].append((time.perf_counter() - start) * 1000.0 / len(images))
            same[name] = same.get(name, True) and same_detections(found, reference)
            close[name] = close.get(name, True) and close_detections(found, reference)

    print(f"detector {detector.model_id}, {len(images)} demo images, OpenCV {cv2.__version__}, "
          f"{threads_before} OpenCV threads, median of {args.repeats}")
    print(f"{'arm':<28} {'ms/image':>9} {'vs batch 8':>11}  same detections as batch 8 (bits / close)")
    base = statistics.median(times["batch 8"]) if "batch 8" in times else None
    results: dict[str, dict[str, float | bool]] = {}
    for name in arms:
        ms = statistics.median(times[name])
        ratio = ms / base if base else float("nan")
        results[name] = {"ms_per_image": ms, "ratio": ratio, "same": same[name], "close": close[name]}
        print(f"{name:<28} {ms:>9.1f} {ratio:>10.2f}×  {same[name]} / {close[name]}")

    layers = layer_times(detector, images[:8])
    share = head_share(layers)
    print(f"one batch-8 forward: {sum(layers.values()):.0f} ms; the class-prediction heads "
          f"{100 * share:.0f} %; slowest layers:")
    for name, ms in sorted(layers.items(), key=lambda kv: -kv[1])[:5]:
        print(f"  {ms:7.1f} ms  {name}")
    results["profile"] = {"forward_ms": sum(layers.values()), "head_share": share}
    return results


if __name__ == "__main__":
    main()
