"""The streamed trainer at 10k and 100k images: peak memory, speed and the data-loader stall share
of a small CLIP-like student, side by side in one run.

Each size is the synthetic scale pool (``entry.synth_pool``: demo crops, transformed and
seeded) written as streamed training pairs (``write_synth_training_pairs``: 2 captions an image,
random teacher vectors). A fresh process per size trains the same student, built from config (a
ViT with 4 layers of width 128 on 96×96 inputs, a 2-layer text tower), for the same number of SAFT
steps through ``rde.training.retrieval_training.train`` with the DataLoader's workers, and reports:
its peak RSS, the peak RSS summed over it and its workers (sampled), pairs a second, and the stall
share (time waiting for the next batch over the training loop's time). For contrast, it also gives
what the former loader held before its first step: every training image decoded (the sum of
height × width × 3 over the pool, read from the image headers).

    .venv/bin/python benchmarks/streamed_training.py [--sizes 10000 100000] [--steps 40] [--workers 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build_student(folder: Path) -> Path:
    """The student: a CLIP of random weights built from config (``tests/tiny_models.py``), its vision
    tower a 4-layer ViT of width 128 on 96×96 inputs, its text tower 2 layers of width 64."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import build_tiny_clip

    return build_tiny_clip(folder, width=128, layers=4, heads=4, image_size=96, patch_size=16, text_width=64,
                           projection_dim=64)


def write_inputs(work: Path, n: int) -> tuple[str, int, int]:
    """The pool of ``n`` synthetic images and its pairs (kept in ``work`` between runs); returns the
    pairs' URL, their count and the decoded bytes of the pool's images."""
    from entry.synth_pool import SynthParams, write_synth_pool, write_synth_training_pairs
    from rde.common.image_decoding import read_header
    from storage import Artifact

    pool, pairs = str(work / f"pool-{n}"), str(work / f"pairs-{n}")
    write_synth_pool(str(ROOT / "data" / "demo_pool"), pool, SynthParams(n=n))  # resumable: kept shards reused
    if not Artifact(pairs).is_complete():
        write_synth_training_pairs(pool, pairs, captions_per_image=2, teacher_dim=32)
    decoded = 0
    for _, table in Artifact(pool).iter_shards(["image_bytes"]):
        for data in table.column("image_bytes").to_pylist():
            header = read_header(data, 50_000_000)
            decoded += header.width * header.height * 3
    return pairs, Artifact(pairs).count_rows(), decoded


def _tree_rss_mb() -> tuple[float, float]:
    """(this process's RSS, RSS summed with its children's) now, in MB."""
    import psutil

    me = psutil.Process()
    own = me.memory_info().rss
    children = 0
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            children += child.memory_info().rss
    return own / 2**20, (own + children) / 2**20


def train_child(pairs_url: str, student: str, steps: int, workers: int, batch: int, window: int) -> dict:
    """Train ``steps`` SAFT steps from the stream in this process; report memory, speed, stalls."""
    import torch

    from models.retrieval.dual_encoder import HFClipDualEncoder
    from rde.training.pair_batches import StreamedTraining
    from rde.training.pair_stream import PairIndex, StreamedPairs
    from rde.training.retrieval_training import TrainConfig, train

    torch.set_num_threads(2)
    peaks = {"own": 0.0, "tree": 0.0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            own, tree = _tree_rss_mb()
            peaks["own"], peaks["tree"] = max(peaks["own"], own), max(peaks["tree"], tree)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    torch.manual_seed(0)
    model = HFClipDualEncoder(student)
    index = PairIndex.scan(pairs_url, "train")
    waits: list[float] = []

    class Timed(StreamedTraining):
        """The source, with the wait for each batch recorded."""

        def epoch_batches(self, *args, **kwargs):
            batches = super().epoch_batches(*args, **kwargs)
            while True:
                asked = time.perf_counter()
                item = next(batches, None)
                waits.append(time.perf_counter() - asked)
                if item is None:
                    return
                yield item

    source = Timed(StreamedPairs(index, batch, window, 0, None), workers=workers).for_model(model)
    cfg = TrainConfig(objective="saft", epochs=1, batch_size=batch, lr_start=1e-5, lr_peak=1e-4, seed=0)
    marks: dict[int, float] = {}

    class Enough(Exception):
        pass

    def on_step(done: int, total: int) -> None:
        marks[done] = time.perf_counter()
        if done == steps:
            raise Enough

    with contextlib.suppress(Enough):
        train(model, source, cfg, on_step=on_step)
    stop.set()
    sampler.join()
    # steady state: from the end of step 1 (the workers started, the first batch in) to the last
    loop = marks[steps] - marks[1]
    return {"pairs": len(index), "steps": steps, "peak_rss_mb": round(peaks["own"], 1),
            "peak_tree_rss_mb": round(peaks["tree"], 1), "pairs_per_s": round((steps - 1) * batch / loop, 1),
            "stall_share": round(sum(waits[1:steps]) / loop, 3), "first_batch_s": round(waits[0], 2),
            "index_mb": round((sum(r.nbytes for r in index.rows) + index.q_txt.nbytes) / 2**20, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--work", type=Path, default=None, help="keep the inputs here (default: a temp folder)")
    parser.add_argument("--child", nargs=2, metavar=("PAIRS", "STUDENT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(train_child(*args.child, args.steps, args.workers, args.batch, args.window)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        student = work / "student"
        if not (student / "config.json").exists():
            build_student(student)
        rows = []
        for n in args.sizes:
            began = time.perf_counter()
            pairs_url, pairs, decoded = write_inputs(work, n)
            print(f"{n} images: {pairs} pairs ready ({time.perf_counter() - began:.0f} s)", file=sys.stderr)
            done = subprocess.run([sys.executable, __file__, "--child", pairs_url, str(student),
                                   "--steps", str(args.steps), "--workers", str(args.workers),
                                   "--batch", str(args.batch), "--window", str(args.window)],
                                  capture_output=True, text=True, check=True)
            rows.append({"images": n, **json.loads(done.stdout.strip().splitlines()[-1]),
                         "former_loader_decoded_mb": round(decoded / 2**20, 1)})
    print(f"batch {args.batch}, {args.steps} SAFT steps, {args.workers} DataLoader workers, window {args.window}")
    print("| images | pairs | peak RSS (MB) | with workers (MB) | pairs/s | stall share | first batch (s) "
          "| pair index (MB) | former loader: decoded images (MB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['images']} | {r['pairs']} | {r['peak_rss_mb']} | {r['peak_tree_rss_mb']} | {r['pairs_per_s']} "
              f"| {r['stall_share']} | {r['first_batch_s']} | {r['index_mb']} | {r['former_loader_decoded_mb']} |")
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        print(f"RSS {b['images']} / {a['images']}: {b['peak_rss_mb'] / a['peak_rss_mb']:.3f}x "
              f"(with workers {b['peak_tree_rss_mb'] / a['peak_tree_rss_mb']:.3f}x); "
              f"pairs/s {b['pairs_per_s'] / a['pairs_per_s']:.3f}x")


if __name__ == "__main__":
    main()
