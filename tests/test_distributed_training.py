"""Data-parallel training on the CPU (``gloo``, two processes): a step's loss and gradients are those
of one process on the same global batch (SAFT's soft targets and ITM over the gathered batch, GTR+
weights, parts of unequal size), and a two-process training run ends with the one-process model,
over cached features and over streamed pairs with a CLIP-like student.
``train_data_parallel`` (the stage's way in, with rank 0's progress, losses and checkpoints) runs in
the train-gtr flow test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_retrieval_training import _model, _pairs

from rde.training.distributed import average_gradients, current, run_group
from rde.training.retrieval_training import TrainConfig, batch_loss, train

STEP = TrainConfig(objective="saft", use_itm=True, batch_size=15, seed=3)
RUN = TrainConfig(objective="saft", epochs=2, batch_size=15, lr_start=1e-3, lr_peak=1e-2, seed=3)
STREAMED = TrainConfig(objective="saft", epochs=1, batch_size=16, lr_start=1e-4, lr_peak=1e-3, seed=3)


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    idx = torch.randperm(48, generator=g)[:15]  # 15 pairs: parts of 8 and 7
    return idx, torch.randint(3, (15,), generator=g), torch.rand(15, generator=g) + 0.5


def _step(ranks: object) -> dict[str, object]:
    model, pairs = _model(), _pairs()
    idx, views, weights = _batch()
    terms = batch_loss(model, pairs, idx, views, STEP, weights, ranks)
    terms["total"].backward()
    params = [p for p in model.parameters() if p.requires_grad]
    average_gradients(params, ranks)
    return {"terms": {k: float(v.detach()) for k, v in terms.items()},
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def _streamed_run(pairs_url: str, clip: str) -> tuple[dict, list[dict]]:
    """A CLIP-like student trained one epoch from streamed pairs (in a group: each rank reads and
    preprocesses its part of every batch, with its own DataLoader worker)."""
    from models.retrieval.dual_encoder import HFClipDualEncoder
    from rde.training.pair_batches import StreamedTraining
    from rde.training.pair_stream import PairIndex, StreamedPairs

    torch.manual_seed(0)
    model = HFClipDualEncoder(clip)
    source = StreamedTraining(StreamedPairs(PairIndex.scan(pairs_url), 16, 40, 0, None), workers=1).for_model(model)
    result = train(model, source, STREAMED)
    return model.state_dict(), result.step_losses


def _member(rank: int, world: int, out: str, pairs_url: str, clip: str) -> None:
    step = _step(current())
    model = _model()
    result = train(model, _pairs(), RUN)  # in the group: data-parallel
    streamed = _streamed_run(pairs_url, clip)
    if rank == 0:
        torch.save({"step": step, "model": model.state_dict(), "losses": result.step_losses, "streamed": streamed},
                   out)


def test_two_gloo_processes_match_one_process(tmp_path: Path, small_pool_url: str) -> None:
    """One process group for the three checks (starting one costs seconds of imports)."""
    from tiny_models import build_tiny_clip

    from entry.synth_pool import write_synth_training_pairs

    out, pairs_url = tmp_path / "rank0.pt", str(tmp_path / "pairs")
    write_synth_training_pairs(small_pool_url, pairs_url, captions_per_image=1, teacher_dim=8)
    clip = str(build_tiny_clip(tmp_path / "clip"))
    run_group(_member, 2, str(tmp_path / "rendezvous"), "gloo", str(out), pairs_url, clip)
    two = torch.load(out, weights_only=False)
    one = _step(None)
    assert set(two["step"]["terms"]) == set(one["terms"]) >= {"itc", "sass", "isd", "itm", "total"}
    for name, value in one["terms"].items():
        assert two["step"]["terms"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert set(two["step"]["grads"]) == set(one["grads"]) and one["grads"]
    for name, grad in one["grads"].items():
        assert torch.allclose(two["step"]["grads"][name], grad, rtol=1e-4, atol=1e-6), name

    # a whole data-parallel run: the same steps, losses and final weights as one process
    whole = _model()
    reference = train(whole, _pairs(), RUN)
    assert [s["step"] for s in two["losses"]] == [s["step"] for s in reference.step_losses] == list(range(1, 9))
    assert [s["total"] for s in two["losses"]] == pytest.approx([s["total"] for s in reference.step_losses],
                                                                rel=1e-5)
    for name, value in whole.state_dict().items():
        assert torch.allclose(two["model"][name], value, rtol=1e-4, atol=1e-5), name

    # streamed pairs and a CLIP-like student with SAFT's soft targets: the same run in one process
    weights, losses = _streamed_run(pairs_url, clip)
    assert [s["step"] for s in two["streamed"][1]] == [s["step"] for s in losses] == list(range(1, 7))
    for term in ("total", "sass", "isd"):
        assert [s[term] for s in two["streamed"][1]] == pytest.approx([s[term] for s in losses], rel=1e-4), term
    for name, value in weights.items():
        # a key bias adds the same term to all of a query's attention logits, so its gradient is 0 but
        # for rounding, which AdamW scales up to steps of the learning rate: not comparable
        if not name.endswith("k_proj.bias"):
            assert torch.allclose(two["streamed"][0][name], value, rtol=1e-3, atol=1e-5), name
