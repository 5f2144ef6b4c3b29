"""Step time of ITC vs ITC+SASS+ISD (SAFT) with the teacher precomputed, side by side in one run.

The same model, batch and optimiser; each step is forward + backward + AdamW update. Teacher
vectors come from the cached features, so SAFT adds only the N×N softmaxes and KL terms. Runs
alternate in ABBA blocks; medians per step are compared. Target: SAFT / ITC ≤ 1.05.
Shapes default to the CPU model (image input 384 + 1280, text 384, teacher 384) at the paper's
batch size 128; ``--image-dim`` / ``--text-dim`` model bigger towers' projection sizes.

    .venv/bin/python benchmarks/saft_step_time.py [--batch 128] [--steps 60]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from models.retrieval.dual_encoder import FeatureDualEncoder
from rde.training.retrieval_training import TrainConfig, TrainingPairs, batch_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--text-dim", type=int, default=384)
    parser.add_argument("--cnn-dim", type=int, default=1280)
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    n, d, c = 4096, args.text_dim, args.cnn_dim
    pairs = TrainingPairs(torch.randn(3, n, d + c), torch.arange(n), torch.randn(n, d), torch.randn(n, d),
                          torch.randn(n, d), torch.rand(n))
    timings: dict[str, list[float]] = {"itc": [], "saft": []}
    models = {k: FeatureDualEncoder(d, c, d) for k in timings}
    optims = {k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4) for k, m in models.items()}
    cfgs = {"itc": TrainConfig(objective="itc"), "saft": TrainConfig(objective="saft")}
    gen = torch.Generator().manual_seed(0)

    def step(kind: str) -> None:
        idx = torch.randint(n, (args.batch,), generator=gen)
        views = torch.randint(3, (args.batch,), generator=gen)
        start = time.perf_counter()
        loss = batch_loss(models[kind], pairs, idx, views, cfgs[kind], None)["total"]
        optims[kind].zero_grad()
        loss.backward()
        optims[kind].step()
        timings[kind].append(time.perf_counter() - start)

    for _ in range(5):  # warm-up
        step("itc")
        step("saft")
    timings = {"itc": [], "saft": []}
    for i in range(args.steps):
        for kind in (("itc", "saft") if i % 2 == 0 else ("saft", "itc")):
            step(kind)
    itc, saft = statistics.median(timings["itc"]), statistics.median(timings["saft"])
    print(f"batch {args.batch}, image input {d}+{c}, text {d}, teacher {d}; median of {args.steps} steps each:")
    print("\n| objective | ms/step |\n|---|---|")
    print(f"| ITC | {1000 * itc:.2f} |\n| ITC+SASS+ISD (SAFT) | {1000 * saft:.2f} |")
    print(f"\nratio SAFT / ITC: {saft / itc:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
